"""How many blocks a node serves when neither ``--blocks`` nor ``--num-blocks`` is given: what its memory holds.

The budget is a fraction of the memory free now (GPU memory on CUDA; available RAM on a CPU, shared with the rest of
the machine, hence the smaller fraction) less a fixed margin for activations, the CUDA context and allocator slack.
Each block costs its weights at the chosen dtype/quantization plus room for ``cache_tokens`` tokens of its KV cache.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from swarm_node.capacity import available_ram, block_weight_bytes
from swarm_node.quantize import Quant
from swarm_node.span import kv_bytes_per_token

GPU_MEMORY_FRACTION = 0.9
CPU_RAM_FRACTION = 0.5
MARGIN_BYTES = 512 * 2**20
RESERVED_CACHE_TOKENS = 4096  # KV room kept per block when --cache-tokens is not given


class NotEnoughMemory(ValueError):
    """Not even one block fits in the memory this node has."""


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_ram()


def auto_num_blocks(
    config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    quant: Quant,
    cache_tokens: int | None = None,
    free_bytes: int | None = None,
) -> int:
    """Blocks that fit, at most the model's; ``free_bytes`` overrides the measured free memory (tests)."""
    free = free_bytes if free_bytes is not None else free_memory(device)
    fraction = GPU_MEMORY_FRACTION if device.type == "cuda" else CPU_RAM_FRACTION
    budget = free * fraction - MARGIN_BYTES
    tokens = cache_tokens or RESERVED_CACHE_TOKENS
    per_block = block_weight_bytes(config, dtype, quant) + kv_bytes_per_token(config, 1, dtype) * tokens
    count = min(int(config.num_hidden_layers), int(budget // per_block))
    if count < 1:
        raise NotEnoughMemory(
            f"{free / 2**30:.2f} GiB free on {device} holds no block of this model (one takes {per_block / 2**30:.2f}"
            f" GiB with {tokens} tokens of cache, beside a {MARGIN_BYTES // 2**20} MiB margin): quantize (--quant"
            " int8 or nf4), lower --cache-tokens, or free memory"
        )
    return count
