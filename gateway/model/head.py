"""The gateway's part of the model: token embeddings, the final norm and the LM head (tied or not).

Families put more here: Gemma scales the embeddings by sqrt(hidden) and soft-caps the logits
(``cap * tanh(logits / cap)``), BLOOM normalizes the embeddings (a LayerNorm) before the first block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from gateway.model.head_adapters import HeadAdapter
from shared.families import family_of
from shared.packed_linear import PackedLinear
from shared.weights import WeightReader


class ModelHead(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        embed: torch.Tensor,
        norm: dict[str, torch.Tensor],
        lm_head: torch.Tensor,
        embed_norm: dict[str, torch.Tensor] | None = None,
    ):
        """``norm`` / ``embed_norm``: the norm modules' state (``weight``, and ``bias`` for a LayerNorm)."""
        super().__init__()
        family = family_of(config)
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        scale = family.embed_scale(config)
        # In the embeddings' dtype, as transformers multiplies (Gemma's sqrt(3072) is 55.5 in bfloat16).
        self.embed_scale = None if scale is None else torch.tensor(scale, dtype=embed.dtype)
        self.embed_norm = None if embed_norm is None else _norm_with(family.final_norm(config), embed_norm)
        self.norm = _norm_with(family.final_norm(config), norm)
        self.logit_softcap = family.final_logit_softcap(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        # Tied embeddings share one tensor; nothing is copied.
        self.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)
        # What the logits are computed with: the same weight, prepacked for batched decode (one more V x D copy in
        # float32 on the CPU; see shared/packed_linear.py).
        self.scorer = PackedLinear(lm_head)
        self.adapters: dict[str, HeadAdapter] = {}  # LoRA adapters' embedding / LM-head parts, by served name

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """token_ids: [B, T] -> hidden [B, T, D]: what the first block takes (with ``adapter``'s embedding update)."""
        if adapter is None:
            hidden = self.embed_tokens(token_ids)
        else:
            hidden = self.adapters[adapter].embed_ids(self.embed_tokens, token_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if self.embed_norm is not None:
            hidden = self.embed_norm(hidden)
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, adapters: Sequence[str | None] | None = None) -> torch.Tensor:
        """hidden: [B, T, D] (the last block's output) -> logits [B, T, V] in float32.

        ``adapters``: row b's adapter (None: the base model's head), applied on top of the one batched product."""
        normed = self.norm(hidden)
        logits = self.scorer(normed)
        for name in {name for name in adapters or () if name is not None}:
            rows = torch.tensor([row for row, used in enumerate(adapters or ()) if used == name])
            logits = logits.index_copy(0, rows, self.adapters[name].logits(logits[rows], normed[rows]).to(logits.dtype))
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float()


def _norm_with(norm: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    norm.load_state_dict(state, strict=True, assign=True)
    for parameter in norm.parameters():
        parameter.requires_grad_(False)
    return norm


def _read_norm(reader: WeightReader, prefix: str, norm: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    names = {local: f"{prefix}.{local}" for local in norm.state_dict()}
    tensors = reader.read(names.values())
    return {local: tensors[name].to(dtype) for local, name in names.items()}


def build_head(
    config: PretrainedConfig,
    reader: WeightReader,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ModelHead:
    """The head on ``device``: its LM head takes oneDNN's packed layout only on the CPU, so it is built where it runs
    (a packed CPU head cannot move to CUDA)."""
    family = family_of(config)
    layout = family.layout
    available = reader.names()
    tied = bool(getattr(config, "tie_word_embeddings", False)) or layout.lm_head not in available
    names = [layout.embed] + ([] if tied else [layout.lm_head])
    tensors = {name: t.to(device=device, dtype=dtype) for name, t in reader.read(names).items()}
    norm = _read_norm(reader, layout.final_norm, family.final_norm(config), dtype)
    embed_norm = None
    if layout.embed_norm is not None:
        embed_norm = _read_norm(reader, layout.embed_norm, family.final_norm(config), dtype)
    lm_head = tensors[layout.embed] if tied else tensors[layout.lm_head]
    return ModelHead(config, tensors[layout.embed], norm, lm_head, embed_norm).to(device).eval()
