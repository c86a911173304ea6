"""The gateway's parts of LoRA adapters: updates to the token embeddings and the LM head.

A PEFT adapter may target ``embed_tokens`` (a low-rank pair whose A's columns are tokens) and ``lm_head`` (a pair like
any linear), or replace either whole (``modules_to_save``). Everything inside the blocks is the nodes'; anything else
outside them (the final norm, say) is refused, since no process would apply it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional
from transformers import PretrainedConfig

from shared.errors import ModelLoadError
from shared.families import family_of
from shared.lora import LoraPair, adapter_modules, load_adapter


@dataclass(frozen=True)
class HeadAdapter:
    embed: LoraPair | None = None  # a [r, V], b [D, r]
    embed_weight: torch.Tensor | None = None  # [V, D]: replaces the embeddings (modules_to_save)
    lm_head: LoraPair | None = None  # a [r, D], b [V, r]
    lm_head_weight: torch.Tensor | None = None  # [V, D]: replaces the LM head

    def embed_ids(self, base: torch.nn.Embedding, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, T] -> embeddings [B, T, D] with this adapter's update (before any family scaling)."""
        hidden = base(token_ids) if self.embed_weight is None else functional.embedding(token_ids, self.embed_weight)
        if self.embed is not None:
            hidden = hidden + self.embed.embedding_delta(token_ids).to(hidden.dtype)
        return hidden

    def logits(self, base: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """base: the base head's logits [N, T, V] of ``normed`` [N, T, D] -> this adapter's."""
        if self.lm_head_weight is not None:
            base = normed.to(self.lm_head_weight.dtype) @ self.lm_head_weight.T
        if self.lm_head is not None:
            base = base + self.lm_head.delta(normed).to(base.dtype)
        return base


def _module(tensor_name: str) -> str:
    return tensor_name.removesuffix(".weight")


def load_head_adapter(folder: Path, config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> HeadAdapter:
    """The adapter's embedding and LM-head parts (only their tensors are read), in ``dtype``."""
    layout = family_of(config).layout
    embed, lm_head = _module(layout.embed), _module(layout.lm_head)
    pairs, replaced = adapter_modules(folder)
    blocks = layout.blocks + "."
    outside = sorted(m for m in pairs | replaced if not m.startswith(blocks) and m not in (embed, lm_head))
    if outside:
        raise ModelLoadError(f"the adapter in {folder} changes {', '.join(outside)}, which no process applies")
    adapter = load_adapter(folder.name, folder, lambda module: module in (embed, lm_head))

    def pair(module: str) -> LoraPair | None:
        found = adapter.pairs.get(module)
        return None if found is None else found.to("cpu", dtype)

    def weight(module: str) -> torch.Tensor | None:
        found = adapter.replaced.get(module)
        return None if found is None else found.to(dtype)

    return HeadAdapter(pair(embed), weight(embed), pair(lm_head), weight(lm_head))


def load_head_adapters(
    adapters: Mapping[str, Path], config: PretrainedConfig, dtype: torch.dtype = torch.float32
) -> dict[str, HeadAdapter]:
    return {name: load_head_adapter(folder, config, dtype) for name, folder in adapters.items()}
