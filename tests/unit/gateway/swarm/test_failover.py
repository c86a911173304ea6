"""A chain's failover (``gateway.swarm.failover``) when the request goes away in the middle of it."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from hivemind.p2p import P2P

from gateway.swarm.failover import Failover, FailoverPolicy
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.node_session import NodeSession
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from gateway.swarm.segment import Segment
from shared.errors import NodeUnreachable


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
