"""A node's speed: measured once per (model, device, dtype, quantization) and cached on disk.

Speed is kept per block (seconds one decode token spends in one block, and per prompt token in a prefill chunk),
so a cached figure serves any span length the node later takes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

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


def speed_key(model: str, device: torch.device, dtype: torch.dtype, quant: str) -> str:
    return f"{model}|{device.type}|{str(dtype).removeprefix('torch.')}|{quant}"


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
        path.write_text(json.dumps(entries, indent=1))
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
    cached = load_cached(cache_path, key)
    if cached is not None:
        logger.info("using cached speed for %s", key)
        return cached
    speed = await measure(backend)
    store_cached(cache_path, key, speed)
    return speed
