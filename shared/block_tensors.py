"""A block's parameters from a checkpoint: transformers' parameter names mapped to the checkpoint's tensor names.

Mostly a prefix (``model.layers.3.`` / ``transformer.h.3.``). Mixture-of-experts blocks differ: transformers 5 keeps
each block's experts fused in two 3D tensors while checkpoints keep one linear per expert, so those are assembled
here from exactly this block's expert tensors (see ``ExpertLayout``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from shared.families import ExpertLayout, family_of
from shared.weights import WeightReader

FUSED_GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2I, D]: per expert, gate rows then up rows
FUSED_DOWN = "mlp.experts.down_proj"  # [E, D, I]


@dataclass(frozen=True)
class _Source:
    names: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor]


def _single(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _stack_gate_up(tensors: list[torch.Tensor]) -> torch.Tensor:
    # tensors: gate_0, up_0, gate_1, up_1, ... each [I, D] -> [E, 2I, D]
    pairs = zip(tensors[0::2], tensors[1::2], strict=True)
    return torch.stack([torch.cat(pair, dim=0) for pair in pairs])


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors)


def _expert_source(local: str, prefix: str, experts: ExpertLayout, config: PretrainedConfig) -> _Source:
    stem = f"{prefix}{experts.module}.experts"
    count = range(experts.num_experts(config))
    if local == FUSED_GATE_UP:
        names = [f"{stem}.{e}.{kind}.weight" for e in count for kind in (experts.gate, experts.up)]
        return _Source(tuple(names), _stack_gate_up)
    return _Source(tuple(f"{stem}.{e}.{experts.down}.weight" for e in count), _stack)


def _source(local: str, prefix: str, config: PretrainedConfig, available: set[str]) -> _Source:
    experts = family_of(config).experts
    direct = f"{prefix}{local}"
    if experts is None or direct in available or not local.startswith("mlp."):
        return _Source((direct,), _single)
    if local in (FUSED_GATE_UP, FUSED_DOWN):
        return _expert_source(local, prefix, experts, config)
    return _Source((f"{prefix}{experts.module}.{local.removeprefix('mlp.')}",), _single)  # router, shared expert


def block_tensor_names(
    config: PretrainedConfig, block: int, local_names: Iterable[str], available: set[str]
) -> set[str]:
    """Every checkpoint tensor the block's parameters are made from."""
    prefix = family_of(config).layout.block_prefix(block)
    return {name for local in local_names for name in _source(local, prefix, config, available).names}


def read_block(
    config: PretrainedConfig, reader: WeightReader, block: int, local_names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The block's state dict (transformers' names, relative to the block), read from exactly its tensors."""
    prefix = family_of(config).layout.block_prefix(block)
    available = reader.names()
    sources = {local: _source(local, prefix, config, available) for local in local_names}
    tensors = reader.read({name for source in sources.values() for name in source.names})
    return {local: source.combine([tensors[n] for n in source.names]) for local, source in sources.items()}
