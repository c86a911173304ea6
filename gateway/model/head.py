"""The gateway's part of the model: token embeddings, the final norm and the LM head (tied or not)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from shared.families import family_of
from shared.packed_linear import PackedLinear
from shared.weights import WeightReader

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


class ModelHead(nn.Module):
    def __init__(self, config: PretrainedConfig, embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.norm = family_of(config).rms_norm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm.weight = nn.Parameter(norm, requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        # Tied embeddings share one tensor; nothing is copied.
        self.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)
        # What the logits are computed with: the same weight, prepacked for batched decode (one more V x D copy in
        # float32 on the CPU; see shared/packed_linear.py).
        self.scorer = PackedLinear(lm_head)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [B, T] -> hidden [B, T, D]."""
        return self.embed_tokens(token_ids)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, T, D] (the last block's output) -> logits [B, T, V] in float32."""
        return self.scorer(self.norm(hidden)).float()


def build_head(config: PretrainedConfig, reader: WeightReader, dtype: torch.dtype = torch.float32) -> ModelHead:
    available = reader.names()
    tied = bool(getattr(config, "tie_word_embeddings", False)) or LM_HEAD not in available
    names = [EMBED, FINAL_NORM] + ([] if tied else [LM_HEAD])
    tensors = {name: t.to(dtype) for name, t in reader.read(names).items()}
    lm_head = tensors[EMBED] if tied else tensors[LM_HEAD]
    return ModelHead(config, tensors[EMBED], tensors[FINAL_NORM], lm_head).eval()
