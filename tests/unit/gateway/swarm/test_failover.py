"""A chain's failover (``gateway.swarm.failover``) when the request goes away in the middle of it, and a new chain
some of whose nodes are full."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import pytest
import torch
from hivemind.p2p import P2P

from gateway.swarm.chain_session import ChainSession
from gateway.swarm.failover import Failover, FailoverPolicy
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.node_session import NodeSession
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from gateway.swarm.segment import Segment
from gateway.swarm.view import SwarmView
from shared.errors import CacheFull, NodeUnreachable
from shared.server_records import NodeState, ServerRecord


class _OpeningForever:
    """A node session whose open never answers (a node frozen while the chain fails over to it)."""

    def __init__(self, hop: Hop) -> None:
        self.hop = hop
        self.pusher: str | None = None
        self.closed = False
        self.on_open: asyncio.Event | None = None

    async def open(self, alloc_timeout: float = 0.0) -> None:
        if self.on_open is not None:
            self.on_open.set()
        await asyncio.Event().wait()

    async def close(self) -> None:
        self.closed = True


async def test_a_failover_cancelled_while_its_replacement_opens_closes_the_replacement() -> None:
    """The replacement is in no chain yet: left open, its node would hold the session's room until idle expiry (a
    client that left during a failover leaked a node session that way)."""
    router = Router(cast(SwarmMonitor, None), cast(P2P, None))
    built: list[_OpeningForever] = []
    opened = asyncio.Event()  # a replacement's open is under way

    def new_session(hop: Hop) -> NodeSession:
        built.append(_OpeningForever(hop))
        built[-1].on_open = opened
        return cast(NodeSession, built[-1])

    failover = Failover(router, FailoverPolicy(), new_session, lambda: 16, None)

    async def route(start: int, end: int, busy: frozenset[str], fresh: bool) -> list[Hop]:
        return [Hop("other", start, end)]

    failover._route = route  # type: ignore[method-assign]
    failed = Segment(cast(NodeSession, _OpeningForever(Hop("lost", 0, 3))))
    segments = [failed]
    task = asyncio.create_task(failover.replace(segments, failed, NodeUnreachable("gone")))
    opening = asyncio.ensure_future(opened.wait())
    await asyncio.wait([task, opening], timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert built and not task.done(), task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert built[0].closed and segments == [failed]


class _Node:
    """A node's side of the sessions opened on it: ``full`` refuses an open that does not wait for room, and grants
    one that does (room freed while it waited)."""

    def __init__(self, full: bool) -> None:
        self.full = full
        self.sessions: list[_Session] = []
        self.refusals_after_wait = 0  # opens that wait for room and are refused all the same, before one is granted
        self.fails_steps = False


class _Session:
    def __init__(self, hop: Hop, node: _Node, log: list[tuple[str, float, list[str]]], live: list[_Session]) -> None:
        self.hop, self.node, self.log, self.live = hop, node, log, live
        self.pusher: str | None = None
        self.closed = False

    async def open(self, alloc_timeout: float = 0.0) -> None:
        self.log.append((self.hop.peer_id, alloc_timeout, [s.hop.peer_id for s in self.live]))
        if self.node.full and alloc_timeout <= 0:
            raise CacheFull("16 tokens asked, 0 free")
        self.live.append(self)

    async def replay(self, chunks: list[object], tree: object = None) -> list[object]:
        return []

    async def close(self) -> None:
        self.closed = True
        if self in self.live:
            self.live.remove(self)


async def test_a_new_chain_refused_room_by_one_node_holds_none_on_the_others_while_it_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a full swarm, a new session that kept the nodes that took it while it waited for room on another held a
    quarter of the swarm's KV memory from sessions that could decode (the simulator's finding, stop 45): the chain
    lets go of every node, then waits on the full one first, and opens the rest once it has room there."""
    nodes = {"a": _Node(full=False), "b": _Node(full=True)}
    log: list[tuple[str, float, list[str]]] = []  # (node, its wait for room, the chain's sessions open then)
    live: list[_Session] = []
    monkeypatch.setattr(ChainSession, "_new_session", lambda self, hop: _Session(hop, nodes[hop.peer_id], log, live))
    router = Router(cast(SwarmMonitor, None), cast(P2P, None))

    async def route(max_length: int, start: int = 0, end: int | None = None, **_: object) -> list[Hop]:
        hops = [Hop("a", 0, 3), Hop("b", 3, 6)]
        return [
            Hop(h.peer_id, max(h.start, start), min(h.end, end or 6))
            for h in hops
            if h.end > start and h.start < (end or 6)
        ]

    router.route = route  # type: ignore[method-assign]
    chain = ChainSession(cast(P2P, None), router, 16, 5.0)
    await asyncio.wait_for(chain.open(), 10)
    assert chain.hops == [Hop("a", 0, 3), Hop("b", 3, 6)]
    waited = [(peer, held) for peer, wait, held in log if wait > 0]
    assert waited == [("b", [])], log  # it waited on b holding nothing, a's room given back first
    assert [peer for peer, _, _ in log] == ["a", "b", "b", "a"]
    assert sorted(s.hop.peer_id for s in live) == ["a", "b"]


class _StepSession(_Session):
    """A node session that steps (adds 1 to its input), replays (recording what it was given) and may fail a step."""

    def __init__(self, hop: Hop, node: _Node, log: list[tuple[str, float, list[str]]], live: list[_Session]) -> None:
        super().__init__(hop, node, log, live)
        self.replayed: list[int] = []
        self.stepped: list[int] = []

    async def open(self, alloc_timeout: float = 0.0) -> None:
        self.log.append((self.hop.peer_id, alloc_timeout, [s.hop.peer_id for s in self.live]))
        if self.node.full and (alloc_timeout <= 0 or self.node.refusals_after_wait > 0):
            self.node.refusals_after_wait -= alloc_timeout > 0
            raise CacheFull("16 tokens asked, 0 free")
        self.live.append(self)

    async def replay(
        self, chunks: list[tuple[int, torch.Tensor]], tree: object = None
    ) -> list[tuple[int, torch.Tensor]]:
        self.replayed += [position for position, _ in chunks]
        return [(position, chunk + 1) for position, chunk in chunks]

    async def step(
        self, hidden: torch.Tensor, position: int, tree: object = None, branch: object = None
    ) -> torch.Tensor:
        if self.node.fails_steps:
            raise NodeUnreachable("gone")
        self.stepped.append(position)
        return hidden + 1


def _clipping_router(later: Callable[[], list[Hop]]) -> Router:
    """A router (neither the DHT nor the network read) whose routes are a's 0:3 then ``later()``'s hops, clipped to
    the range asked."""
    router = Router(cast(SwarmMonitor, None), cast(P2P, None))

    async def route(max_length: int, start: int = 0, end: int | None = None, **_: object) -> list[Hop]:
        end = 6 if end is None else end
        return [
            Hop(h.peer_id, max(h.start, start), min(h.end, end))
            for h in [Hop("a", 0, 3), *later()]
            if h.end > start and h.start < end
        ]

    router.route = route  # type: ignore[method-assign]
    return router


async def test_a_chain_whose_lost_range_waits_on_a_full_node_lets_go_of_its_other_nodes_then_starts_the_step_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mid-stream, a failover that held the rest of its chain while it waited for room on a full node kept that
    room from everyone: after a region went dark every chain waited, holding room, on a node full of chains waiting
    on another, until all were lost (the simulator's finding, stop 46). Once the full node refuses again after a
    wait, the chain lets go of every node, opens again whole (the full node first), is replayed up to the step, and
    the step starts over from the first hop."""
    nodes = {"a": _Node(full=False), "b": _Node(full=False), "c": _Node(full=True)}
    nodes["c"].refusals_after_wait = 1  # room frees during its second wait
    log: list[tuple[str, float, list[str]]] = []
    live: list[_Session] = []
    built: list[_StepSession] = []

    def new_session(self: ChainSession, hop: Hop) -> _StepSession:
        built.append(_StepSession(hop, nodes[hop.peer_id], log, live))
        return built[-1]

    monkeypatch.setattr(ChainSession, "_new_session", new_session)
    router = _clipping_router(lambda: [Hop("b" if not nodes["b"].fails_steps else "c", 3, 6)])
    chain = ChainSession(cast(P2P, None), router, 16, 5.0)
    await asyncio.wait_for(chain.open(), 10)
    prompt = torch.zeros(1, 4, 2)
    assert torch.equal(await chain.step(prompt, 0), prompt + 2)
    nodes["b"].fails_steps = True  # b dies; c, the only other server of 3:6, is full
    token = torch.ones(1, 1, 2)
    output = await asyncio.wait_for(chain.step(token, 4), 20)
    assert torch.equal(output, token + 2)
    assert chain.hops == [Hop("a", 0, 3), Hop("c", 3, 6)]
    waits = [(peer, held) for peer, wait, held in log if wait > 0]
    assert waits == [("c", ["a"]), ("c", [])], log  # the first wait held a; the second held nothing
    new_a, new_c = (next(s for s in reversed(built) if s.hop.peer_id == peer) for peer in ("a", "c"))
    assert new_a.replayed == [0] and new_c.replayed == [0]  # replayed up to the step, never the step itself
    assert new_a.stepped == [4] and new_c.stepped == [4]  # then the step, once, from the first hop
    assert not built[0].live.count(built[0]) and built[0].closed  # the first a let go
    assert sorted(s.hop.peer_id for s in live) == ["a", "c"]


def _record(peer: str, start: int, end: int, room: int) -> ServerRecord:
    return ServerRecord(
        peer_id=peer,
        start=start,
        end=end,
        state=NodeState.ONLINE,
        throughput=10.0,
        cache_tokens_left=room,
        version="test",
        protocol=1,
    )


async def test_a_failover_routed_over_a_node_read_as_full_waits_there_for_room_from_the_first_ask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node the route took though its record says it has no room for the session would refuse an open without a
    wait, and the next route take another node like it: in a full 100-node swarm four in five refusals and four in
    five routes were such a walk (the simulator, stop 53). The failover asks it to hold the open until it has room at
    once."""
    nodes = {"a": _Node(full=False), "b": _Node(full=False), "c": _Node(full=True)}
    log: list[tuple[str, float, list[str]]] = []
    live: list[_Session] = []
    monkeypatch.setattr(
        ChainSession, "_new_session", lambda self, hop: _StepSession(hop, nodes[hop.peer_id], log, live)
    )
    router = _clipping_router(lambda: [Hop("b" if not nodes["b"].fails_steps else "c", 3, 6)])
    servers = [_record("a", 0, 3, 1000), _record("b", 3, 6, 1000), _record("c", 3, 6, 0)]
    router.last_view = SwarmView(6, {s.peer_id: s for s in servers}, 0.0, {s.peer_id: 100.0 for s in servers})
    chain = ChainSession(cast(P2P, None), router, 16, 5.0)
    await asyncio.wait_for(chain.open(), 10)
    await chain.step(torch.zeros(1, 4, 2), 0)
    nodes["b"].fails_steps = True  # b dies; c, the only other server of 3:6, reads as full
    token = torch.ones(1, 1, 2)
    assert torch.equal(await asyncio.wait_for(chain.step(token, 4), 20), token + 2)
    assert chain.hops == [Hop("a", 0, 3), Hop("c", 3, 6)]
    assert [(peer, wait > 0) for peer, wait, _ in log if peer == "c"] == [("c", True)], log  # asked once, waited on
    assert router.stats.capacity_refusals == 0


async def test_a_node_read_as_full_is_not_waited_on_while_the_failover_holds_another_that_had_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node read as short of room may have room all the same (its record was made before a session there ended):
    once one of those took the lost range's first hop, the next one read as full is asked without a wait, and only
    after it refused is it waited on, first, with nothing of the range held. Waiting on it while holding the other
    kept that room from everyone for the whole wait (the simulator's let-go run, stop 53)."""
    nodes = {"a": _Node(full=False), "b": _Node(full=False), "c": _Node(full=True), "d": _Node(full=False)}
    log: list[tuple[str, float, list[str]]] = []
    live: list[_Session] = []
    monkeypatch.setattr(
        ChainSession, "_new_session", lambda self, hop: _StepSession(hop, nodes[hop.peer_id], log, live)
    )
    after_b = [Hop("d", 3, 4), Hop("c", 4, 6)]
    router = _clipping_router(lambda: after_b if nodes["b"].fails_steps else [Hop("b", 3, 6)])
    servers = [_record("a", 0, 3, 1000), _record("b", 3, 6, 1000), _record("d", 3, 4, 0), _record("c", 4, 6, 0)]
    router.last_view = SwarmView(6, {s.peer_id: s for s in servers}, 0.0, {s.peer_id: 100.0 for s in servers})
    chain = ChainSession(cast(P2P, None), router, 16, 5.0)
    await asyncio.wait_for(chain.open(), 10)
    await chain.step(torch.zeros(1, 4, 2), 0)
    nodes["b"].fails_steps = True  # b dies; d (room) and c (none) serve 3:6, both announcing none
    token = torch.ones(1, 1, 2)
    assert torch.equal(await asyncio.wait_for(chain.step(token, 4), 20), token + 3)
    assert chain.hops == [Hop("a", 0, 3), Hop("d", 3, 4), Hop("c", 4, 6)]
    waits = [(peer, held) for peer, wait, held in log if wait > 0]
    assert waits == [("d", ["a"]), ("c", ["a"])], log  # c waited on with only the chain's own a held
