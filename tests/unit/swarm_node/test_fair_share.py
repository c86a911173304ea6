"""Fair share at a node: a peer alone may use all of it; while another peer uses the node or waits for room, no
peer takes more than its share of the cache, of sessions or of queued steps — and the refusal is the retryable
``CacheFull`` the gateway routes around. Holdings are read from the session registry itself."""

from __future__ import annotations

import pytest
import torch

from shared.errors import CacheFull
from swarm_node.cache_pool import CachePool
from swarm_node.fair_share import FairShare, ShareLimits
from swarm_node.kv_cache import SessionKV
from swarm_node.sessions import SessionRegistry

POOL = 1000


def _node(limits: ShareLimits | None = None) -> tuple[FairShare, SessionRegistry, CachePool]:
    pool = CachePool(POOL)
    registry = SessionRegistry(300.0)
    return FairShare(limits or ShareLimits(), POOL, registry.holdings), registry, pool


async def _open(registry: SessionRegistry, pool: CachePool, peer: str, tokens: int) -> None:
    kv = SessionKV(0, 1, 1, 2, 1, torch.float32, torch.device("cpu"))
    registry.add(kv, await pool.allocate(tokens), owner=peer)


async def test_a_peer_alone_may_take_the_whole_pool_but_not_more_once_another_arrives() -> None:
    fair, registry, pool = _node()
    for _ in range(3):
        fair.check_room("a", 300, new_session=True)
        await _open(registry, pool, "a", 300)  # 900 of 1000: nobody else is here
    await _open(registry, pool, "b", 50)
    with pytest.raises(CacheFull, match="fair share of 500") as refused:
        fair.check_room("a", 10, new_session=True)
    assert refused.value.retryable
    fair.check_room("b", 450, new_session=True)  # b is under its share
    with pytest.raises(CacheFull):
        fair.check_room("b", 451, new_session=True)
    for session in [s for s in registry._sessions.values() if s.owner == "b"]:
        registry.close(session)  # b left: a is alone again
    fair.check_room("a", 100, new_session=False)
    assert registry.holdings()["a"].tokens == 900 and "b" not in registry.holdings()


async def test_a_peer_waiting_for_room_stops_those_over_their_share() -> None:
    fair, registry, pool = _node()
    await _open(registry, pool, "a", 900)
    fair.check_room("a", 50, new_session=True)  # alone
    with fair.waiting("b"), pytest.raises(CacheFull):  # b's open waits for room (alloc_timeout)
        fair.check_room("a", 50, new_session=True)
    fair.check_room("a", 50, new_session=True)  # b gave up: a is alone again


async def test_sessions_are_capped_per_peer_while_others_use_the_node() -> None:
    fair, registry, pool = _node(ShareLimits(max_sessions=2))
    for _ in range(3):
        await _open(registry, pool, "a", 10)  # alone: no cap
    await _open(registry, pool, "b", 10)
    with pytest.raises(CacheFull, match="holds 3 sessions"):
        fair.check_room("a", 10, new_session=True)
    fair.check_room("a", 10, new_session=False)  # growth within the token share is fine
    fair.check_room("b", 10, new_session=True)


def test_queued_steps_are_capped_per_peer_while_another_has_steps() -> None:
    fair, _, _ = _node(ShareLimits(max_queued_steps=2))
    held = [fair.step("a") for _ in range(3)] + [fair.step("b")]  # a alone took 3: no cap then
    for step in held:
        step.__enter__()
    with pytest.raises(CacheFull, match="3 steps queued"), fair.step("a"):
        pass
    for step in held:
        step.__exit__(None, None, None)
    with fair.step("b"), fair.step("a"), fair.step("a"):
        pass  # the counts went back down
    assert not fair.contended("a")
