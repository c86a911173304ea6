"""The error-code -> recovery table, and what each recovery teaches the router: capacity never bans, faults ban
(capped), departed nodes stay out of routing until they announce again."""

from __future__ import annotations

from typing import cast

import pytest
from hivemind.p2p import P2P

from gateway.swarm.bans import MAX_BAN_SECONDS, BanList
from gateway.swarm.departures import Departures
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.recovery import RECOVERY, Recovery, recovery_for
from gateway.swarm.router import Router
from gateway.swarm.view import SwarmView
from shared import errors
from shared.dht_records import NodeState, ServerRecord


@pytest.mark.parametrize(
    ("error", "recovery"),
    [
        (errors.NodeUnreachable("gone"), Recovery.GONE),
        (errors.StepTimeout("slow"), Recovery.FAULT),
        (errors.MalformedReply("nan"), Recovery.FAULT),
        (errors.BadReceipt("unsigned"), Recovery.FAULT),
        (errors.NodeInternalError("boom"), Recovery.FAULT),
        (errors.CacheFull("full"), Recovery.BUSY),
        (errors.NodeDraining("draining"), Recovery.STALE),
        (errors.WrongSpan("moved"), Recovery.STALE),
        (errors.ProtocolMismatch("old"), Recovery.STALE),
        (errors.MissingBlocks([3]), Recovery.WAIT),
        (errors.BadRequest("ours"), Recovery.FAIL),
        (errors.UnknownSession("lost"), Recovery.FAIL),
        (errors.PositionOutOfRange("long"), Recovery.FAIL),
        (errors.Unauthorized("secret"), Recovery.FAIL),
        (errors.error_from_code("code_of_a_newer_node", "?"), Recovery.FAIL),
        (RuntimeError("not ours"), Recovery.FAIL),
    ],
)
def test_each_error_code_has_one_recovery(error: BaseException, recovery: Recovery) -> None:
    assert recovery_for(error) is recovery


def test_only_faults_ban_and_capacity_or_state_never_does() -> None:
    assert {r for r in Recovery if r.bans} == {Recovery.FAULT}
    assert {r for r in Recovery if r.until_announced} == {Recovery.GONE, Recovery.STALE}
    for code in (errors.CacheFull.code, errors.NodeDraining.code):
        assert not RECOVERY[code].bans


def test_every_retryable_error_is_recovered_from() -> None:
    retryable = [
        errors.CacheFull,
        errors.NodeDraining,
        errors.NodeInternalError,
        errors.NodeUnreachable,
        errors.StepTimeout,
        errors.MalformedReply,
        errors.BadReceipt,
    ]
    for cls in retryable:
        assert cls.retryable and RECOVERY[cls.code] is not Recovery.FAIL, cls
    assert not errors.RemoteError.retryable and errors.RemoteError.code not in RECOVERY


def test_a_burst_of_failures_bans_for_minutes_not_hours() -> None:
    now = [0.0]
    bans = BanList(clock=lambda: now[0])
    lengths = [bans.record_failure("X") for _ in range(15)]
    assert lengths[:3] == [15, 30, 60]
    assert max(lengths) == MAX_BAN_SECONDS == 300  # was 15 * 2**14 = 245,760 s
    assert [bans.record_failure("Y") for _ in range(200)][-1] == MAX_BAN_SECONDS  # no overflow however many
    now[0] += MAX_BAN_SECONDS + 1
    assert bans.banned() == frozenset()


def record(peer: str, state: NodeState = NodeState.ONLINE) -> ServerRecord:
    return ServerRecord(peer_id=peer, start=0, end=4, state=state, version="x", protocol=3)


def view_at(fetched_at: float, **stamps: float) -> SwarmView:
    return SwarmView(4, {peer: record(peer) for peer in stamps}, fetched_at, dict(stamps))


def test_a_departed_node_is_hidden_until_it_announces_again() -> None:
    now = [100.0]
    departures = Departures(clock=lambda: now[0])
    departures.depart("A")
    # a view fetched before the departure cannot tell its old record from a new one: hidden
    assert set(departures.filter(view_at(99.0, A=500.0, B=500.0)).servers) == {"B"}
    now[0] = 101.0
    # the first view after it: the record it had (stamp 510) is remembered, and hidden however long it lingers
    assert set(departures.filter(view_at(100.5, A=510.0, B=510.0)).servers) == {"B"}
    assert set(departures.filter(view_at(120.0, A=510.0, B=530.0)).servers) == {"B"}
    assert "A" in departures
    # it announced again: a newer expiration
    assert set(departures.filter(view_at(125.0, A=535.0, B=535.0)).servers) == {"A", "B"}
    assert "A" not in departures


def test_a_departed_node_whose_record_expired_is_forgotten() -> None:
    departures = Departures(clock=lambda: 100.0)
    departures.depart("A")
    assert departures.filter(view_at(101.0, B=500.0)).servers.keys() == {"B"}
    assert "A" not in departures


def router() -> Router:
    monitor = cast(SwarmMonitor, None)  # record_failure reads neither the DHT nor the network
    return Router(monitor, cast(P2P, None))


def test_the_router_learns_from_each_recovery() -> None:
    r = router()
    r.record_failure("full", Recovery.BUSY)
    r.record_failure("draining", Recovery.STALE)
    r.record_failure("dead", Recovery.GONE)
    r.record_failure("broken", Recovery.FAULT)
    assert r.bans.banned() == {"broken"}  # neither full nor draining nor dead nodes are banned
    assert r.departures.peers() == {"draining", "dead"}
    assert (r.stats.bans, r.stats.departures, r.stats.capacity_refusals) == (1, 2, 1)


def test_waiting_sessions_are_counted_by_block_range() -> None:
    r = router()
    with r.waiting_for(15, 30), r.waiting_for(15, 30), r.waiting_for(0, 3):
        assert r.waiting == {"15:30": 2, "0:3": 1}
    assert not r.waiting
