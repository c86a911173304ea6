"""The liveness watch: an overdue reply makes the waiter ping the node; a failed or unanswered ping ends the wait at
once, a live node keeps its whole step timeout. The ping (the info RPC) is the seam: it is replaced by a scripted one
here; tests/integration/test_failover.py proves the same with real processes and signals."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from hivemind.p2p import P2P

from gateway.swarm import liveness
from gateway.swarm.liveness import Liveness
from shared.errors import NodeUnreachable, StepTimeout, Unauthorized


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "PROBE_FLOOR", 0.05)
    monkeypatch.setattr(liveness, "PING_PERIOD", 0.05)


def scripted_ping(monkeypatch: pytest.MonkeyPatch, outcome: Exception | None) -> list[str]:
    pinged: list[str] = []

    async def fetch_info(p2p: P2P, peer_id: str, wait: float, auth: object = None) -> object:
        pinged.append(peer_id)
        if outcome is not None:
            raise outcome
        return object(), 0.001

    monkeypatch.setattr(liveness, "fetch_info", fetch_info)
    return pinged


def never() -> asyncio.Future[int]:
    return asyncio.get_running_loop().create_future()


@pytest.mark.parametrize(
    "ping_error", [NodeUnreachable("failed to dial"), StepTimeout("no answer")], ids=["dead", "frozen"]
)
async def test_a_dead_or_frozen_node_ends_the_wait_long_before_the_step_timeout(
    monkeypatch: pytest.MonkeyPatch, ping_error: Exception
) -> None:
    pinged = scripted_ping(monkeypatch, ping_error)
    reply = never()
    with pytest.raises(NodeUnreachable):
        await asyncio.wait_for(Liveness(cast(P2P, None)).wait("A", "answer", reply, limit=600), 60)
    assert pinged == ["A"]
    assert reply.cancelled()  # the pending reply is given up


async def test_a_live_node_that_answers_pings_keeps_its_whole_step_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    pinged = scripted_ping(monkeypatch, Unauthorized("an answer all the same"))
    with pytest.raises(StepTimeout):
        await Liveness(cast(P2P, None)).wait("A", "answer", never(), limit=0.4)
    assert len(pinged) >= 2  # it kept pinging, and waited on


async def test_a_prompt_reply_pings_nobody_and_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    pinged = scripted_ping(monkeypatch, NodeUnreachable("never asked"))
    watch = Liveness(cast(P2P, None))
    reply = never()
    reply.set_result(7)
    assert await watch.wait("A", "answer", reply, limit=10) == 7
    assert pinged == [] and "A" in watch.reply_times


async def test_concurrent_waiters_share_one_ping(monkeypatch: pytest.MonkeyPatch) -> None:
    pinged = scripted_ping(monkeypatch, NodeUnreachable("gone"))
    watch = Liveness(cast(P2P, None))
    results = await asyncio.gather(
        *(watch.wait("A", "answer", never(), limit=600) for _ in range(8)), return_exceptions=True
    )
    assert all(isinstance(r, NodeUnreachable) for r in results)
    assert pinged == ["A"]


async def test_a_waiter_whose_timer_fires_a_moment_later_takes_the_same_ping(monkeypatch: pytest.MonkeyPatch) -> None:
    # A loaded loop fires waiters' timers in different turns: a ping answered a moment ago still answers for them.
    monkeypatch.setattr(liveness, "PING_PERIOD", 1.0)
    pinged = scripted_ping(monkeypatch, NodeUnreachable("gone"))
    watch = Liveness(cast(P2P, None))
    first = asyncio.ensure_future(watch.wait("A", "answer", never(), limit=600))
    await asyncio.sleep(0.02)
    second = asyncio.ensure_future(watch.wait("A", "answer", never(), limit=600))
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert all(isinstance(r, NodeUnreachable) for r in results)
    assert pinged == ["A"]
