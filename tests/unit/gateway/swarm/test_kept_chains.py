"""Parked chains: shrunk to what they hold, closed when evicted, expired, on a node that left, or at engine close."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.swarm.kept_chains import KeptChains
from gateway.swarm.routing import Hop
from gateway.swarm.view import SwarmView
from shared.dht_records import NodeState, ServerRecord


@dataclass
class FakeChain:
    """What ``KeptChains`` uses of a ``ChainSession``."""

    max_length: int
    hops: list[Hop] = field(default_factory=lambda: [Hop("node-a", 0, 2), Hop("node-b", 2, 4)])
    fail_resize: bool = False
    closed: bool = False

    async def resize(self, max_length: int) -> None:
        if self.fail_resize:
            raise ConnectionError("node gone")
        self.max_length = max_length

    async def close(self) -> None:
        self.closed = True


def view_of(*online: str) -> SwarmView:
    servers = {
        peer: ServerRecord(peer_id=peer, start=0, end=4, state=NodeState.ONLINE, version="x", protocol=2)
        for peer in online
    }
    return SwarmView(4, servers)


async def test_a_kept_chain_is_shrunk_and_taken_by_the_next_turn() -> None:
    kept = KeptChains(lambda: asyncio.sleep(0, view_of("node-a", "node-b")), keep_alive=60, max_kept=2)
    chain = FakeChain(max_length=50)
    await kept.keep("key", list(range(30)), chain)  # type: ignore[arg-type]
    taken = kept.take("key", [*range(30), 99])
    assert taken is not None and taken.prefix == 30
    await taken.item.shrunk
    assert chain.max_length == 30 and not chain.closed  # room for what it holds, no more


async def test_evicted_unshrinkable_and_leftover_chains_are_closed() -> None:
    kept = KeptChains(lambda: asyncio.sleep(0, view_of()), keep_alive=60, max_kept=1)
    first, second = FakeChain(40), FakeChain(40, fail_resize=True)
    await kept.keep("key", [1, 2, 3], first)  # type: ignore[arg-type]
    await kept.keep("key", [1, 2, 3], second)  # type: ignore[arg-type]
    assert first.closed  # beyond max_kept: the least recently kept goes
    taken = kept.take("key", [1, 2, 3, 4])
    assert taken is not None
    await taken.item.shrunk
    assert second.closed  # a chain that could not shrink is not kept holding room
    third = FakeChain(3)
    await kept.keep("key", [1, 2, 3], third)  # type: ignore[arg-type]
    await kept.close()
    assert third.closed
    fourth = FakeChain(3)
    await kept.keep("key", [1, 2, 3], fourth)  # type: ignore[arg-type]
    assert fourth.closed and len(kept.pool) == 0  # after the engine closed: never parked


async def until(condition: Callable[[], bool]) -> bool:
    for _ in range(500):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_the_sweeper_closes_chains_on_nodes_that_left() -> None:
    online = {"node-a", "node-b", "node-c"}
    kept = KeptChains(lambda: asyncio.sleep(0, view_of(*online)), keep_alive=60, max_kept=4)
    try:
        leaving = FakeChain(3, hops=[Hop("node-c", 0, 4)])
        staying = FakeChain(3)
        await kept.keep("key", [1, 2, 3], leaving)  # type: ignore[arg-type]
        await kept.keep("key", [4, 5, 6], staying)  # type: ignore[arg-type]
        online.discard("node-c")  # draining: it waits for its sessions to end, so free them before expiry
        await kept.sweep()
        assert leaving.closed and not staying.closed and len(kept.pool) == 1
    finally:
        await kept.close()
    assert staying.closed


async def test_the_sweeper_closes_expired_chains() -> None:
    kept = KeptChains(lambda: asyncio.sleep(0, view_of("node-a", "node-b")), keep_alive=0.2, max_kept=4)
    kept.start()
    try:
        chain = FakeChain(3)
        await kept.keep("key", [1, 2, 3], chain)  # type: ignore[arg-type]
        assert await until(lambda: chain.closed) and len(kept.pool) == 0
    finally:
        await kept.close()
