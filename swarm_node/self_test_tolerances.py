"""How far a node's self-test lets its span's outputs differ from the known answer (``swarm_node.self_test``).

Errors are relative L2 over what the block(s) add to their input, on the self-test's seeded inputs. Measured on a
CPU (2026-12-01, transformers 5.24, torch 2.13; the commands are in docs/NODE_CHECKS.md), most seen → allowed:

* cache (prefill of 8 vs prefill of 7 + decode), whole span: float32 2.1e-6 (SmolLM2-135M, 30 blocks; every tiny
  family ≤ 8.3e-7) → 1e-4; bfloat16 0 on the CPU (both paths run the same kernels) → 5e-2, room for GPU kernels
  that differ between prefill and decode shapes (not measured here: no GPU). A cache that keeps nothing
  (``--faulty-outputs stale-cache``) is off by 0.27 (Falcon) to 1.3 (Gemma): above both. Quantized spans add
  their own: LLM.int8 picks its 16-bit outlier columns from all rows of a forward, so 8 rows and 1 row round
  differently: 0.074 (SmolLM2 int8; tiny spans ≤ 3.1e-4) → 0.15; nf4 0.007 (SmolLM2) → 5e-2.
* quantized block vs the same block in float32: int8 0.045 (SmolLM2, worst of 30 blocks; tiny families ≤ 0.019)
  → 0.15; nf4 0.47 (SmolLM2, worst block; its GGUF is Q4_1, quantized again; tiny families ≤ 0.20) → 0.75.
  A block whose weights are wrong altogether is off by about 1.4 (two independent draws: √2).
"""

from __future__ import annotations

import torch

CACHE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
CACHE_QUANT_TOLERANCE = {"none": 0.0, "int8": 0.15, "nf4": 5e-2}
QUANT_TOLERANCE = {"int8": 0.15, "nf4": 0.75}


def cache_tolerance(dtype: torch.dtype, quant: str) -> float:
    return max(CACHE_TOLERANCE[dtype], CACHE_QUANT_TOLERANCE[quant])


def quant_tolerance(quant: str) -> float:
    return QUANT_TOLERANCE[quant]
