"""A node's speed: measured once for all the nodes that share a machine's cache, keyed by what changes it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node import throughput
from swarm_node.backend import SpanBackend
from swarm_node.span import build_span
from swarm_node.throughput import BlockSpeed, block_speed, load_cached, speed_key
from tests.tiny_models import GetTinyModel

CPU = torch.device("cpu")


async def test_nodes_starting_together_measure_once(
    tiny_model: GetTinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second waits for the first's figure (a lock beside the cache) rather than measuring beside it."""
    source = resolve_model(str(tiny_model("llama").folder))
    config = load_config(source)
    backends = [SpanBackend(build_span(config, open_weights(source, config), a, a + 2)) for a in (0, 2)]
    measured: list[SpanBackend] = []
    measure = throughput.measure

    async def counting(backend: SpanBackend) -> BlockSpeed:
        measured.append(backend)
        return await measure(backend)  # the real measurement

    monkeypatch.setattr(throughput, "measure", counting)
    cache, key = tmp_path / "speed.json", speed_key("tiny", CPU, torch.float32, "none", 1)
    try:
        speeds = await asyncio.gather(*(block_speed(backend, cache, key) for backend in backends))
    finally:
        for backend in backends:
            backend.shutdown()
    assert len(measured) == 1
    assert speeds[0] == speeds[1] == load_cached(cache, key)


def test_the_key_holds_what_changes_the_figure() -> None:
    base = speed_key("m", CPU, torch.float32, "none", 1)
    assert torch.__version__ in base
    others = [
        speed_key("m", CPU, torch.float32, "none", 2),
        speed_key("m", CPU, torch.bfloat16, "none", 1),
        speed_key("m", CPU, torch.float32, "int8", 1),
        speed_key("other", CPU, torch.float32, "none", 1),
    ]
    assert len({base, *others}) == 5
