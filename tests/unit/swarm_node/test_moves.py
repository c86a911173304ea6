"""A node's move (``SpanServer._maybe_move``), the DHT and the loading stubbed: what it announces while it drains and
loads, and how long it drains."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest

import swarm_node.server
from shared.dht_records import NodeState, ServerRecord
from swarm_node.server import SpanServer
from swarm_node.settings import NodeSettings
from tests.tiny_models import NUM_LAYERS, GetTinyModel

ME = "me"
DRAIN_TIMEOUT = 1.0


def record(peer: str, start: int, end: int, throughput: float = 10.0) -> ServerRecord:
    return ServerRecord(
        peer_id=peer, start=start, end=end, state=NodeState.ONLINE, throughput=throughput, version="t", protocol=1
    )


class Backend:
    queue_depth = 0

    def shutdown(self) -> None:
        pass


class Moved(NamedTuple):
    announced: list[ServerRecord]  # the records the node announced
    drained: float  # the seconds it drained
    server: SpanServer
    reads: int  # how often it read the swarm's records from the DHT


async def move(
    tiny_model: GetTinyModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    others: list[ServerRecord],
    later: list[ServerRecord] | None = None,
    load_fails: bool = False,
) -> Moved:
    """A node on blocks 0:2 of the tiny llama, with a session open, checks whether to move among ``others`` (from
    its third read of the DHT on, ``later``)."""
    settings = NodeSettings(
        model=str(tiny_model("llama").folder),
        num_blocks=2,
        device="cpu",
        drain_timeout=DRAIN_TIMEOUT,
        throughput_cache=str(tmp_path / "throughput.json"),
        config_cache=str(tmp_path / "configs"),
    )
    server = SpanServer(settings)
    server.start, server.end = 0, 2
    server.status.state = NodeState.ONLINE
    server.dht = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: ME))
    server.handlers = SimpleNamespace(backend=Backend(), use_backend=lambda b: None)  # type: ignore[assignment]
    announced: list[ServerRecord] = []
    drained: list[float] = []

    reads: list[None] = []

    async def fetch(*_: Any) -> dict[str, ServerRecord]:
        reads.append(None)
        now = others if later is None or len(reads) < 3 else later
        return {r.peer_id: r for r in [record(ME, server.start, server.end), *now]}

    async def announce(_dht: Any, _model: Any, server_record: ServerRecord, _ttl: float) -> None:
        announced.append(server_record)
        if server_record.state is NodeState.DRAINING:
            drained.append(time.monotonic())

    async def load(start: int, end: int) -> Backend:
        drained.append(time.monotonic())
        if load_fails:
            raise MemoryError(f"no room for blocks {start}:{end}")
        return Backend()

    async def self_test(_backend: Any) -> None:
        pass

    monkeypatch.setattr(swarm_node.server, "fetch_servers", fetch)
    monkeypatch.setattr(swarm_node.server, "GAP_CHECK_PERIOD", DRAIN_TIMEOUT / 20)
    monkeypatch.setattr(swarm_node.server, "announce", announce)
    monkeypatch.setattr(server, "_load", load)
    monkeypatch.setattr(server, "_self_test", self_test)
    async with server.pool.reserve(16):  # a session that does not finish: the drain waits for it
        async with asyncio.timeout(10 * DRAIN_TIMEOUT):
            await server._maybe_move()
    return Moved(announced, drained[-1] - drained[0] if len(drained) == 2 else 0.0, server, len(reads))


async def test_a_moving_node_announces_where_it_goes_while_it_drains_and_loads(
    tiny_model: GetTinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weak = [record("A", 0, 2, 30.0), record("B", 2, 4, 1.0), record("C", 4, NUM_LAYERS, 30.0)]  # 2:4 served, weakly
    announced, drained, server, _ = await move(tiny_model, tmp_path, monkeypatch, weak)
    assert [(r.state, r.start, r.moving_to) for r in announced] == [
        (NodeState.DRAINING, 0, 2),  # still on its old span, counted by others on the new one
        (NodeState.ONLINE, 2, None),
    ]
    assert drained >= DRAIN_TIMEOUT  # its session had the whole drain timeout to finish
    assert (server.start, server.moving_to) == (2, None)


async def test_a_node_moving_to_serve_a_block_nobody_serves_does_not_wait_for_its_sessions(
    tiny_model: GetTinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a block is served by nobody no session of the swarm can go on: the drain would only delay the fix."""
    announced, drained, _, reads = await move(tiny_model, tmp_path, monkeypatch, [record("A", 0, 2), record("B", 4, 6)])
    assert [(r.state, r.start, r.moving_to) for r in announced] == [
        (NodeState.DRAINING, 0, 2),
        (NodeState.ONLINE, 2, None),
    ]
    assert drained < DRAIN_TIMEOUT / 2
    assert reads == 1  # the gap was seen in the records the move was chosen from, not read again


async def test_a_moving_node_stops_draining_once_a_block_of_its_new_span_loses_its_last_server(
    tiny_model: GetTinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator's case: the move is chosen while a crashed node's record still covers a block, which then
    expires; the drain re-reads the swarm and stops waiting."""
    weak = [record("A", 0, 2, 30.0), record("B", 2, 4, 1.0), record("C", 4, NUM_LAYERS, 30.0)]
    announced, drained, _, _ = await move(tiny_model, tmp_path, monkeypatch, weak, later=[weak[0], weak[2]])
    assert [(r.state, r.start) for r in announced] == [(NodeState.DRAINING, 0), (NodeState.ONLINE, 2)]
    assert drained < DRAIN_TIMEOUT / 2


async def test_a_move_whose_load_fails_leaves_the_node_online_where_it_was(
    tiny_model: GetTinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not DRAINING for good, and not announcing a destination it will never reach (others would count it there)."""
    gap = [record("A", 0, 2), record("B", 4, 6)]
    announced, _, server, _ = await move(tiny_model, tmp_path, monkeypatch, gap, load_fails=True)
    assert [(r.state, r.start, r.moving_to) for r in announced] == [
        (NodeState.DRAINING, 0, 2),
        (NodeState.ONLINE, 0, None),
    ]
    assert (server.start, server.moving_to, server.status.state) == (0, None, NodeState.ONLINE)
