"""How an unquantized span's projections are laid out on the CPU, for one row and for batches of rows.

Decode multiplies a few rows (one per session in the batch) by every weight of the span, and which float32 kernel
does that fastest depends on the CPU and on the number of rows:

* MKL's sgemm on a contiguous [in, out] copy of the weight (``TransposedLinear``) is 15-25% faster than on
  ``nn.Linear``'s transposed view at 8-16 rows and as fast at one row (measured on an AVX2-only EPYC), so that is the
  layout every projection gets.
* oneDNN on a weight it has prepacked (``shared.packed_linear``) multiplies 4-16 rows about twice as fast as MKL on an
  AVX-512 EPYC (SmolLM2's projections: 0.9-1.0 vs 1.7 ms per block at 8 rows), but one row 25-30% slower there,
  and on the AVX2-only box it was only ~10% faster for batches.

So by default (``--cpu-batched-copy auto``) the node measures both kernels once, at load, on a batch of rows:
where oneDNN takes at most ``ONEDNN_KEEP_BELOW`` of MKL's time, each projection also keeps a oneDNN-packed copy,
which every forward of two or more rows uses, while single rows stay on MKL. The copy doubles the projections'
memory (SmolLM2, 15 blocks in float32: about 210 MiB per node). RAM is rarely what limits a CPU node; where the gain
is small the copy is not kept, and ``--cpu-batched-copy off`` declines it. A row's result may differ from its
single-row result by float rounding (different kernels), never more.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from shared.packed_linear import PackedLinear, packable

logger = logging.getLogger(__name__)

ONEDNN_KEEP_BELOW = 0.8  # keep the packed copy where oneDNN takes at most this fraction of MKL's time for a batch
PROBE_ROWS = 8  # a typical decode batch
PROBE_SHAPE = (1024, 2048)  # [in, out] of the probe matmul: mid-sized projection


class TransposedLinear(nn.Module):
    """``nn.Linear`` with its weight kept as a contiguous [in, out] matrix for MKL, and optionally a oneDNN-packed
    copy for batches of rows (see the module docstring for why)."""

    def __init__(self, linear: nn.Linear, batched_copy: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.data.t().contiguous(), requires_grad=False)
        bias = linear.bias if isinstance(linear.bias, torch.Tensor) else None  # nn.Linear(bias=False) holds None
        self.bias: nn.Parameter | None = None if bias is None else nn.Parameter(bias.data, requires_grad=False)
        self.batched = PackedLinear(linear.weight.data, self.bias) if batched_copy else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        rows = x.reshape(-1, self.in_features)
        if self.batched is not None and rows.shape[0] > 1:
            out = self.batched(rows)
        elif self.bias is None:
            out = rows @ self.weight_t
        else:
            out = torch.addmm(self.bias, rows, self.weight_t)
        return out.view(*x.shape[:-1], self.out_features)


BatchedCopy = Literal["auto", "on", "off"]


def keep_batched_copy(dtype: torch.dtype, device: torch.device, setting: BatchedCopy = "auto") -> bool:
    """Whether projections of this dtype on this device also keep a oneDNN copy for batches: never where oneDNN
    can't take them, else as ``setting`` says (``auto``: where the probe shows it pays)."""
    if setting == "off" or not packable(dtype, device):
        return False
    return setting == "on" or onednn_pays_for_batches()


@functools.cache
def onednn_pays_for_batches() -> bool:
    """Measured once per process, with the process's thread setting: a batch of ``PROBE_ROWS`` rows through
    oneDNN's packed kernel against MKL's, best of several runs each."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(PROBE_SHAPE[1], PROBE_SHAPE[0], generator=generator)
    rows = torch.randn(PROBE_ROWS, PROBE_SHAPE[0], generator=generator)
    mkl_weight = weight.t().contiguous()
    packed = PackedLinear(weight)
    if not packed.uses_onednn:
        return False
    mkl = _best_seconds(lambda: rows @ mkl_weight)
    onednn = _best_seconds(lambda: packed(rows))
    keep = onednn <= ONEDNN_KEEP_BELOW * mkl
    logger.info(
        "CPU projections: %d rows take %.2f ms with oneDNN, %.2f ms with MKL: %s",
        PROBE_ROWS,
        onednn * 1e3,
        mkl * 1e3,
        "keeping a oneDNN copy for batches" if keep else "MKL only",
    )
    return keep


def _best_seconds(run: Callable[[], object], repeats: int = 7, calls: int = 5) -> float:
    for _ in range(2):  # warm-up: first calls allocate and pick kernels
        run()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - began) / calls)
    return best
