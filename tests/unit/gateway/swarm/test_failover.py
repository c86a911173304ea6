"""A chain's failover (``gateway.swarm.failover``) when the request goes away in the middle of it, and a new chain
some of whose nodes are full."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from hivemind.p2p import P2P

from gateway.swarm.chain_session import ChainSession
from gateway.swarm.failover import Failover, FailoverPolicy
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.node_session import NodeSession
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from gateway.swarm.segment import Segment
from shared.errors import CacheFull, NodeUnreachable


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
