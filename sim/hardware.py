"""GPU classes, quantizations and model shapes, and the per-step cost model a simulated node computes with.

Specs are the vendors' published figures (memory, memory bandwidth, dense bf16/fp16 tensor throughput); the
efficiency factors say how much of them a decode step reaches (sim/ASSUMPTIONS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BANDWIDTH_EFFICIENCY = 0.7  # share of the memory bandwidth a decode step's weight reads reach
COMPUTE_EFFICIENCY = 0.4  # share of the tensor throughput a decode step's matmuls reach
STEP_OVERHEAD = 0.002  # seconds per forward step besides the blocks (kernel launches, Python, serialization)
WEIGHT_SHARE = 0.8  # at most this share of GPU memory holds weights; the rest (less 10 %) is KV cache
MAX_BATCH = 32  # swarm_node's default --max-batch-size: rows of one decode step
MAX_SPAN = 48  # a node serves at most this many blocks (more is rarely worth one node's latency)
LOAD_BANDWIDTH = 1.0e9  # bytes/s a node reads weights from local disk when it (re)loads a span


@dataclass(frozen=True)
class GpuClass:
    name: str
    memory: float  # bytes
    bandwidth: float  # bytes/s
    flops: float  # dense bf16/fp16 tensor FLOP/s
    datacenter: bool  # sits in a data centre (short last mile, longer sessions)
    share: float  # share of the simulated fleet


GB = 1e9
TB = 1e12
GPUS = (
    GpuClass("H100-SXM", 80 * GB, 3.35 * TB, 989e12, True, 0.08),
    GpuClass("A100-80G", 80 * GB, 2.04 * TB, 312e12, True, 0.12),
    GpuClass("A100-40G", 40 * GB, 1.56 * TB, 312e12, True, 0.08),
    GpuClass("L40S", 48 * GB, 0.864 * TB, 362e12, True, 0.07),
    GpuClass("L4", 24 * GB, 0.300 * TB, 121e12, True, 0.10),
    GpuClass("RTX-4090", 24 * GB, 1.008 * TB, 165e12, False, 0.20),
    GpuClass("RTX-3090", 24 * GB, 0.936 * TB, 71e12, False, 0.25),
    GpuClass("T4", 16 * GB, 0.320 * TB, 65e12, True, 0.10),
)


@dataclass(frozen=True)
class Quant:
    name: str
    bytes_per_param: float
    speed: float  # share of bf16's kernel efficiency its (dequantizing) kernels reach


QUANTS = {
    "bf16": Quant("bf16", 2.0, 1.0),
    "int8": Quant("int8", 1.0, 0.55),  # LLM.int8: outlier decomposition costs about half the speed
    "nf4": Quant("nf4", 0.53, 0.75),  # 4 bits and a bf16 scale per 64 weights; dequantized in the kernel
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_blocks: int
    params_per_block: float
    kv_bytes_per_token: float  # per block: keys and values of one token (GQA: 8 KV heads of 128, bf16)


LLAMA_405B = ModelShape("llama-405b", 126, 405e9 / 126, 2 * 8 * 128 * 2)
LLAMA_70B = ModelShape("llama-70b", 80, 70e9 / 80, 2 * 8 * 128 * 2)


@dataclass(frozen=True)
class NodeHardware:
    gpu: GpuClass
    quant: Quant
    model: ModelShape
    num_blocks: int

    @property
    def block_bytes(self) -> float:
        return self.model.params_per_block * self.quant.bytes_per_param

    @property
    def read_time(self) -> float:
        """Seconds one step spends reading one block's weights."""
        return self.block_bytes / (self.gpu.bandwidth * BANDWIDTH_EFFICIENCY * self.quant.speed)

    @property
    def token_time(self) -> float:
        """Seconds one more row adds to one block of a step (2 FLOPs per parameter)."""
        return 2 * self.model.params_per_block / (self.gpu.flops * COMPUTE_EFFICIENCY * self.quant.speed)

    def step_time(self, rows: float, blocks_per_row: float | None = None) -> float:
        """One decode step over the whole span with ``rows`` sessions, each through ``blocks_per_row`` blocks."""
        per_row = self.num_blocks if blocks_per_row is None else blocks_per_row
        return STEP_OVERHEAD + self.num_blocks * self.read_time + rows * per_row * self.token_time

    @property
    def throughput(self) -> float:
        """What the node announces: decode tokens/s one session gets through the whole span."""
        return 1.0 / self.step_time(1)

    @property
    def capacity(self) -> float:
        """Tokens/s through the whole span with full batches: the node's share of the max-flow bound."""
        return MAX_BATCH / self.step_time(MAX_BATCH)

    @property
    def cache_tokens(self) -> int:
        """The KV pool: tokens a session may hold on every block of the span, summed over sessions."""
        free = 0.9 * self.gpu.memory - self.num_blocks * self.block_bytes
        return max(0, int(free / (self.model.kv_bytes_per_token * self.num_blocks)))

    @property
    def load_time(self) -> float:
        return 20.0 + self.num_blocks * self.block_bytes / LOAD_BANDWIDTH


def fit_blocks(gpu: GpuClass, quant: Quant, model: ModelShape) -> int:
    return min(
        MAX_SPAN, model.num_blocks, int(gpu.memory * WEIGHT_SHARE / (model.params_per_block * quant.bytes_per_param))
    )


def sample_hardware(rng: np.random.Generator, model: ModelShape) -> NodeHardware:
    """A GPU by fleet share; the widest precision that fits at least 4 blocks (else the narrowest that fits one)."""
    gpu = GPUS[rng.choice(len(GPUS), p=np.array([g.share for g in GPUS]) / sum(g.share for g in GPUS))]
    for name in ("bf16", "int8", "nf4"):
        if fit_blocks(gpu, QUANTS[name], model) >= 4:
            return NodeHardware(gpu, QUANTS[name], model, fit_blocks(gpu, QUANTS[name], model))
    return NodeHardware(gpu, QUANTS["nf4"], model, max(1, fit_blocks(gpu, QUANTS["nf4"], model)))
