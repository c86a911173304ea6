"""How much KV cache a node offers when ``--cache-tokens`` is not given: what the memory left after the weights holds.

On a GPU: 90% of the memory that will be free once the span's weights are loaded (the rest is headroom for
activations and allocator slack), estimated before loading from the block's parameter count and the quantization.
On a CPU: 16384 tokens, or what fits in a quarter of the RAM available now if that is less — RAM there is shared with
everything else on the machine, and a session's cache is allocated for its whole ``max_length`` when it opens.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from pathlib import Path

import torch
from transformers import PretrainedConfig

from shared.families import family_of
from swarm_node.quantize import QUANTIZED_PROJECTIONS, Quant
from swarm_node.quantized_experts import FUSED_EXPERT_PARAMS
from swarm_node.span import kv_bytes_per_token, prepare_config

GPU_FREE_FRACTION = 0.9
CPU_DEFAULT_TOKENS = 16384
CPU_RAM_FRACTION = 0.25
MIN_CACHE_TOKENS = 256  # below this a node could not hold even one short session: refuse to start instead

# Bytes per weight of a quantized projection: int8 keeps one float32 scale per output row (counted apart);
# nf4 packs two weights a byte plus one absmax per 64 weights, itself 8-bit quantized (double quantization).
_QUANT_WEIGHT_BYTES = {"int8": 1.0, "nf4": 0.5 + 1 / 64}


def block_weight_bytes(config: PretrainedConfig, dtype: torch.dtype, quant: Quant) -> int:
    """Bytes one decoder block's parameters take on the device."""
    with torch.device("meta"):
        block = family_of(config).decoder_layer(prepare_config(config), 0)
    element = torch.empty(0, dtype=dtype).element_size()
    total = 0.0
    for name, param in block.named_parameters():
        module_name = name.rsplit(".", 2)[-2]
        projection = module_name in QUANTIZED_PROJECTIONS and name.endswith(".weight")
        experts = name.rsplit(".", 1)[-1] in FUSED_EXPERT_PARAMS and param.dim() == 3
        if quant != "none" and (projection or experts):
            rows = param.numel() // param.shape[-1]
            total += param.numel() * _QUANT_WEIGHT_BYTES[quant] + (4 * rows if quant == "int8" else 0)
        else:
            total += param.numel() * element
    return int(total)


def default_cache_tokens(
    config: PretrainedConfig,
    num_blocks: int,
    device: torch.device,
    dtype: torch.dtype,
    quant: Quant,
    free_bytes: int | None = None,
) -> int:
    """The pool size in tokens; ``free_bytes`` overrides the measured free memory (tests)."""
    per_token = kv_bytes_per_token(config, num_blocks, dtype)
    if device.type == "cuda":
        free = free_bytes if free_bytes is not None else torch.cuda.mem_get_info(device)[0]
        room = (free - num_blocks * block_weight_bytes(config, dtype, quant)) * GPU_FREE_FRACTION
        tokens = int(room // per_token)
    else:
        available = free_bytes if free_bytes is not None else available_ram()
        tokens = min(CPU_DEFAULT_TOKENS, int(available * CPU_RAM_FRACTION // per_token))
    if tokens < MIN_CACHE_TOKENS:
        raise ValueError(
            f"only {max(tokens, 0)} tokens of KV cache fit in the memory left for {num_blocks} blocks on {device}:"
            " serve fewer blocks, quantize (--quant), or set --cache-tokens"
        )
    return tokens


def available_ram() -> int:
    """Bytes of RAM available to new allocations (Linux's MemAvailable; free pages elsewhere)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def return_freed_memory() -> None:
    """Hand memory freed while loading (per-block float32 copies of quantized weights) back to the OS.

    glibc keeps freed heap pages mapped, so without this a quantized CPU node's resident memory stays near that of an
    unquantized one (measured on SmolLM2's 15-block span: nf4 674 -> 502 MiB, int8 667 -> 523 MiB).
    """
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
