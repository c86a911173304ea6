"""A node's speed: measured once per machine and setup, and cached on disk.

The cache key is everything that changes the figure: the model, the device (and the GPU's name), dtype,
quantization, torch's version and the compute threads. Speed is kept per block (seconds one decode token spends in
one block, and per prompt token in a prefill chunk), so a cached figure serves any span the node later takes.

Nodes that start together on one machine measure one at a time (a lock file beside the cache): the first measures,
the others find its figure when they get the lock. Measuring side by side, each figure was taken while the other
nodes competed for the same cores, and every node paid for a measurement.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shared.file_lock import held_async
from swarm_node.backend import SpanBackend

logger = logging.getLogger(__name__)

DECODE_STEPS = 8
PREFILL_TOKENS = 128


@dataclass(frozen=True)
class BlockSpeed:
    decode_seconds: float  # per token per block, one session decoding
    prefill_seconds: float  # per token per block, inside a prefill chunk

    def throughputs(self, num_blocks: int) -> tuple[float, float]:
        """(decode tokens/s, prefill tokens/s) through ``num_blocks`` blocks."""
        return 1.0 / (self.decode_seconds * num_blocks), 1.0 / (self.prefill_seconds * num_blocks)


def speed_key(model: str, device: torch.device, dtype: torch.dtype, quant: str, threads: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    kind = str(dtype).removeprefix("torch.")
    return f"{model}|{name}|{kind}|{quant}|torch {torch.__version__}|{threads} threads"


def load_cached(path: Path, key: str) -> BlockSpeed | None:
    try:
        entry = json.loads(path.read_text())[key]
        return BlockSpeed(float(entry["decode_seconds"]), float(entry["prefill_seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_cached(path: Path, key: str, speed: BlockSpeed) -> None:
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
        entries[key] = asdict(speed)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1))
        partial.replace(path)  # readers that do not hold the lock (a node's start) never see half a file
    except (OSError, ValueError):
        logger.warning("cannot write the throughput cache %s", path, exc_info=True)


async def measure(backend: SpanBackend) -> BlockSpeed:
    """Time decode steps and one prefill chunk through the loaded span."""
    blocks = range(backend.span.start, backend.span.end)
    hidden_size = backend.span.hidden_size
    kv = await backend.new_session_kv(blocks, PREFILL_TOKENS + DECODE_STEPS + 1)
    prompt = torch.randn(1, PREFILL_TOKENS, hidden_size)
    await backend.step(kv, prompt[:, :8], 0)  # warm-up
    began = time.perf_counter()
    await backend.step(kv, prompt, 0)
    prefill = (time.perf_counter() - began) / PREFILL_TOKENS / len(blocks)
    token = torch.randn(1, 1, hidden_size)
    began = time.perf_counter()
    for offset in range(DECODE_STEPS):
        await backend.step(kv, token, PREFILL_TOKENS + offset)
    decode = (time.perf_counter() - began) / DECODE_STEPS / len(blocks)
    return BlockSpeed(decode, prefill)


async def block_speed(backend: SpanBackend, cache_path: Path, key: str) -> BlockSpeed:
    async with held_async(cache_path.with_name(cache_path.name + ".lock")):  # one node measures at a time
        cached = load_cached(cache_path, key)  # read under the lock: another node may have just measured it
        if cached is not None:
            logger.info("speed from the cache: %s", key)
            return cached
        speed = await measure(backend)
        store_cached(cache_path, key, speed)
    logger.info("speed measured: %.2f ms a decode token per block (%s)", 1000 * speed.decode_seconds, key)
    return speed
