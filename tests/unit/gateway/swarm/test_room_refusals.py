"""A node that refused a session for room is read as that short by the next opens until it announces a record newer
than the refusal (or the bound passes); capacity is never a ban (pure parts, no processes)."""

from __future__ import annotations

from typing import cast

import pytest
from hivemind.p2p import P2P

from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.recovery import Recovery
from gateway.swarm.room_refusals import REFUSAL_BOUND, RoomRefusals
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop, RouteRequest, RoutingMode, plan_route
from gateway.swarm.view import SwarmView
from shared.server_records import NodeState, ServerRecord

SESSION = 2048  # tokens of the sessions opened here


def record(peer: str, throughput: float) -> ServerRecord:
    return ServerRecord(
        peer_id=peer,
        start=0,
        end=30,
        state=NodeState.ONLINE,
        throughput=throughput,
        cache_tokens_left=100_000,  # what the (stale) record says: plenty
        version="test",
        protocol=1,
    )


def swarm(fetched_at: float, fast_stamp: float) -> SwarmView:
    """A fast node (the one every route prefers) and a slower one, both announcing room; ``fast_stamp``: the
    expiration of the fast one's record (it grows with each announcement)."""
    servers = {"fast": record("fast", 50.0), "slow": record("slow", 5.0)}
    return SwarmView(30, servers, fetched_at, {"fast": fast_stamp, "slow": 1_000.0})


def route(view: SwarmView, refusals: RoomRefusals, mode: RoutingMode, tokens: int = SESSION) -> list[str]:
    request = RouteRequest(tokens, rtts={"fast": 0.05, "slow": 0.05}, push=True, room_left=refusals.room_left(view))
    return [hop.peer_id for hop in plan_route(view, request, mode)]


@pytest.mark.parametrize("mode", list(RoutingMode))
def test_a_refused_node_is_passed_over_until_it_announces_a_newer_record(mode: RoutingMode) -> None:
    now = [100.0]
    refusals = RoomRefusals(clock=lambda: now[0])
    assert route(swarm(99.0, 500.0), refusals, mode) == ["fast"]
    refusals.refuse("fast", SESSION)
    now[0] = 101.0
    # the view it was routed on (fetched before the refusal) and the first one after it: the same old record
    assert route(swarm(99.0, 500.0), refusals, mode) == ["slow"]
    assert route(swarm(100.5, 500.0), refusals, mode) == ["slow"]
    now[0] = 108.0
    assert route(swarm(107.0, 500.0), refusals, mode) == ["slow"]
    # it announced again (a newer expiration): its record is trusted again, and the refusal forgotten
    now[0] = 111.0
    assert route(swarm(110.5, 510.0), refusals, mode) == ["fast"]
    assert "fast" not in refusals


def test_a_session_smaller_than_the_one_refused_may_still_go_there() -> None:
    refusals = RoomRefusals(clock=lambda: 100.0)
    refusals.refuse("fast", SESSION)
    assert refusals.room_left(swarm(99.0, 500.0)) == {"fast": SESSION - 1}
    assert route(swarm(99.0, 500.0), refusals, RoutingMode.MIN_LATENCY, tokens=SESSION // 2) == ["fast"]
    refusals.refuse("fast", SESSION // 2)  # the smallest refusal is what it has less than
    assert refusals.room_left(swarm(99.0, 500.0)) == {"fast": SESSION // 2 - 1}


def test_a_refusal_is_forgotten_after_the_bound_or_when_the_record_expires() -> None:
    now = [100.0]
    refusals = RoomRefusals(clock=lambda: now[0])
    refusals.refuse("fast", SESSION)
    refusals.refuse("gone", SESSION)
    now[0] = 101.0
    view = swarm(100.5, 500.0)  # "gone" has no record in a view fetched after its refusal: it expired
    assert refusals.room_left(view) == {"fast": SESSION - 1}
    now[0] = 100.0 + REFUSAL_BOUND
    assert refusals.room_left(view) == {}


def test_the_only_node_of_a_block_is_still_used_after_it_refused() -> None:
    refusals = RoomRefusals(clock=lambda: 100.0)
    refusals.refuse("fast", SESSION)
    only = SwarmView(30, {"fast": record("fast", 50.0)}, 99.0, {"fast": 500.0})
    assert route(only, refusals, RoutingMode.MIN_LATENCY) == ["fast"]


def test_the_router_remembers_a_refusal_for_room_without_a_ban() -> None:
    r = Router(cast(SwarmMonitor, None), cast(P2P, None))  # neither the DHT nor the network is read here
    r.record_failure("fast", Recovery.BUSY, tokens=SESSION)
    view = swarm(0.0, 500.0)
    request = r._route_request(view, SESSION, 0, None, frozenset(), True, None)
    assert request.room_left == {"fast": SESSION - 1}
    assert plan_route(view, request, RoutingMode.MIN_LATENCY) == [Hop("slow", 0, 30)]
    assert r.bans.banned() == frozenset() and r.stats.capacity_refusals == 1


def test_the_hops_routing_reads_as_short_of_room_are_named_by_record_or_by_refusal() -> None:
    """What a failover waits on from the first ask (``failover._build_replacement``): a route's node whose record,
    or a refusal since, says it has less room than the session."""
    r = Router(cast(SwarmMonitor, None), cast(P2P, None))
    view = swarm(99.0, 500.0)
    view.servers["slow"] = view.servers["slow"].model_copy(update={"cache_tokens_left": SESSION - 1})
    r.last_view = view
    hops = [Hop("fast", 0, 15), Hop("slow", 15, 30)]
    assert r.short_of_room(hops, SESSION) == {"slow"}  # its record says so
    assert r.short_of_room(hops, SESSION - 1) == frozenset()  # room for a smaller session
    r.record_failure("fast", Recovery.BUSY, tokens=SESSION)
    assert r.short_of_room(hops, SESSION) == {"fast", "slow"}  # a refusal since the record says so
    assert r.short_of_room(hops, SESSION // 2) == frozenset()
