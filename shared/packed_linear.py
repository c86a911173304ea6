"""A linear layer whose weight oneDNN has laid out ahead of time for its own float32 matmul kernels, on the CPU.

Why not ``nn.Linear``: decode multiplies a few rows (one per concurrent session) by a large weight, and MKL's sgemm
is weak at that shape on CPUs it does not tune for. Measured on this project's CI box (AMD EPYC, AVX2, one thread):
SmolLM2's 49152 × 576 LM head takes 22.7 ms for 8 rows with ``nn.Linear`` and 12.1 ms prepacked (9.0 vs 7.1 ms for
one row), so batching sessions pays off at the head. The reorder and the matmul are the ops PyTorch's own CPU
compiler (inductor) emits for frozen linear layers; where oneDNN is missing, or for other dtypes and devices, the
layer is a plain ``F.linear``. A row's result does not depend on the other rows of its batch (tests check it
bit for bit), so batching never changes a session's tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a weight of this dtype on this device gets oneDNN's layout (else the layer is a plain linear)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """``x @ weight.T (+ bias)`` for x [..., in] -> [..., out]; the weight is kept only in oneDNN's layout."""

    weight_packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.uses_onednn = packable(weight.dtype, weight.device)
        kept = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()) if self.uses_onednn else weight
        self.register_buffer("weight_packed", kept.detach(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")
        return functional.linear(x, self.weight_packed, self.bias)
