"""Quantized mixture-of-experts: transformers' fused 3D expert tensors as one bitsandbytes linear per expert.

transformers 5 keeps a block's experts as ``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I] parameters, which
bitsandbytes cannot quantize; in Mixtral-like models they are most of the weights. ``QuantizedExperts`` takes the
fused module's place with the same forward: rows (tokens of every session in the batch) are grouped by expert, and
each expert the batch routes to runs one matmul over all of its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_fused_experts(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, p, None), torch.Tensor) and getattr(module, p).dim() == 3
        for p in FUSED_EXPERT_PARAMS
    )


def _linear(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` over ``weight`` [out, in], no copy, no bias (the experts we serve have none)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class QuantizedExperts(nn.Module):
    def __init__(self, experts: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__()
        if getattr(experts, "has_bias", False):
            raise ValueError("experts with biases are not supported by the quantized experts module")
        gate_up = cast(torch.Tensor, experts.gate_up_proj).data  # [E, 2I, D]
        down = cast(torch.Tensor, experts.down_proj).data  # [E, D, I]
        self.num_experts = int(gate_up.shape[0])
        self.act_fn = cast(Callable[[torch.Tensor], torch.Tensor], experts.act_fn)
        self.gate_up = nn.ModuleList(make(_linear(gate_up[e])) for e in range(self.num_experts))
        self.down = nn.ModuleList(make(_linear(down[e])) for e in range(self.num_experts))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [N, D], top_k_index / top_k_weights [N, k] -> [N, D]: sum over each row's k experts."""
        output = torch.zeros_like(hidden)
        for expert in top_k_index.unique().tolist():
            rows, slot = torch.where(top_k_index == expert)  # every (row, slot) routed to this expert
            gate, up = self.gate_up[expert](hidden[rows]).chunk(2, dim=-1)
            out = self.down[expert](self.act_fn(gate) * up) * top_k_weights[rows, slot, None]
            output.index_add_(0, rows, out.to(output.dtype))
        return output


def replace_experts(block: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Swap every fused experts module of the block for ``QuantizedExperts`` built with ``make``."""
    targets = [(name, module) for name, module in block.named_modules() if name and is_fused_experts(module)]
    for name, experts in targets:
        parent_name, _, child = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        setattr(parent, child, QuantizedExperts(experts, make))
    return block
