"""A gateway's route plan (``gateway.swarm.route_plan``): chains drawn in proportion to the plan's sessions and only
where every hop fits (``planned.pick``); the demand a plan is sized by (``DemandMeter``); and the plan made from a
view (``view_plan``): its chains' rounds are what ``routing.hop_cost`` charges a pushing chain, the fastest chains
below the optimum, the optimum (KV-bound: more chains) past it, this gateway's part of each pool, and no excluded
node."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest

from gateway.swarm.route_plan.chains import Chain
from gateway.swarm.route_plan.planned import DEMAND_WINDOW, ROOM_WINDOW, DemandMeter, NoPlannedRoom, PlannedChain, pick
from gateway.swarm.route_plan.view_plan import GATEWAY, _graph, plan_of
from gateway.swarm.routing import Hop, RouteRequest, hop_cost
from gateway.swarm.view import SwarmView
from shared.server_records import NodeState, ServerRecord
from tests.unit.gateway.swarm.test_routing import server

BLOCKS = 8
MAX_LENGTH = 1000
WORK = 0.005


record = functools.partial(server, pool=10_000)  # every pool 10,000 tokens, all of it left unless said


def view(*records: ServerRecord) -> SwarmView:
    return SwarmView(BLOCKS, {r.peer_id: r for r in records})


PLAN = [
    PlannedChain(0, (Hop("a", 0, 4), Hop("b", 4, 8)), sessions=3.0),
    PlannedChain(0, (Hop("c", 0, 2), Hop("d", 2, 8)), sessions=1.0),
]
SWARM = [record("a", 0, 4), record("b", 4, 8), record("c", 0, 2), record("d", 2, 8)]


def picks(swarm: list[ServerRecord], request: RouteRequest, draws: int = 4000) -> Counter[str]:
    rng = np.random.default_rng(0)
    return Counter("-".join(h.peer_id for h in pick(PLAN, view(*swarm), request, rng)) for _ in range(draws))


def test_chains_are_drawn_in_proportion_to_the_plans_sessions() -> None:
    drawn = picks(SWARM, RouteRequest(MAX_LENGTH))
    assert set(drawn) == {"a-b", "c-d"}
    assert drawn["a-b"] / 4000 == pytest.approx(0.75, abs=0.02)  # 3 standard deviations


@pytest.mark.parametrize(
    ("swarm", "request_", "left"),
    [
        ([record("b", 4, 8, cache=MAX_LENGTH - 1), *SWARM[2:], SWARM[0]], RouteRequest(MAX_LENGTH), {"c-d"}),
        (SWARM, RouteRequest(MAX_LENGTH, room_left={"a": 10}), {"c-d"}),
        (SWARM, RouteRequest(MAX_LENGTH, banned=frozenset({"d"})), {"a-b"}),
        (SWARM, RouteRequest(MAX_LENGTH, excluded=frozenset({"b"})), {"c-d"}),
        (
            [SWARM[0], SWARM[1], SWARM[2], record("d", 2, 8, state=NodeState.DRAINING)],
            RouteRequest(MAX_LENGTH),
            {"a-b"},
        ),
        ([SWARM[0], SWARM[1], SWARM[2], record("d", 3, 8)], RouteRequest(MAX_LENGTH), {"a-b"}),  # d moved
        ([SWARM[0], SWARM[2], SWARM[3]], RouteRequest(MAX_LENGTH), {"c-d"}),  # b gone
    ],
    ids=["record short of room", "refused since", "banned", "excluded", "draining", "moved", "gone"],
)
def test_a_chain_with_any_hop_unfit_is_never_drawn(
    swarm: list[ServerRecord], request_: RouteRequest, left: set[str]
) -> None:
    assert set(picks(swarm, request_, draws=200)) == left


def test_with_no_planned_chain_fit_pick_says_so() -> None:
    with pytest.raises(NoPlannedRoom):
        pick(PLAN, view(*SWARM), RouteRequest(MAX_LENGTH, banned=frozenset({"a", "c"})), np.random.default_rng(0))


def test_demand_is_arrivals_per_second_times_the_tokens_a_finished_session_decoded() -> None:
    meter = DemandMeter()
    assert meter.demand(100.0) is None and meter.held_length(100.0) is None
    for t in range(100, 200):
        meter.opened(1000 if t % 2 else 3000, float(t))  # one session a second from 100 s on
    assert meter.demand(200.0) is None  # none finished yet: no length to go by
    meter.finished(40, 150.0)
    meter.finished(60, 160.0)
    assert meter.demand(200.0) == pytest.approx(50.0)  # 1 a second since the first (not over the window) x 50
    assert meter.held_length(200.0) == 2000.0
    for t in range(200, 200 + int(DEMAND_WINDOW), 10):
        meter.opened(500, float(t))  # then one every 10 s, each decoding 20
        meter.finished(20, float(t))
    assert meter.demand(200 + DEMAND_WINDOW) == pytest.approx(2.0, rel=0.05)  # the first 100 s forgotten
    assert meter.held_length(200 + DEMAND_WINDOW) == 500.0
    assert meter.demand(200 + 3 * DEMAND_WINDOW) is None  # nobody came for a whole window


def test_while_a_session_finds_no_room_the_demand_is_the_optimums() -> None:
    meter = DemandMeter()
    for t in range(100):
        meter.opened(1000, float(t))
        meter.finished(10, float(t))
    assert meter.demand(100.0) == pytest.approx(10.0)
    meter.short_of_room(100.0)
    assert meter.demand(100.0) is None and meter.demand(100.0 + ROOM_WINDOW - 1) is None
    assert meter.demand(100.0 + ROOM_WINDOW) is not None


# A near chain (a then b, 10 ms links) and a far one (c then d, 200 ms), each node 0.01 s a token through its span.
NEAR_FAR = [
    record("a", 0, 4, throughput=100.0, next_rtts={"b": 0.01}),
    record("b", 4, 8, throughput=100.0),
    record("c", 0, 4, throughput=100.0, next_rtts={"d": 0.2}),
    record("d", 4, 8, throughput=100.0),
]
RTTS = {"a": 0.01, "b": 0.01, "c": 0.2, "d": 0.2}


def chains_of(plan_chains: tuple[PlannedChain, ...]) -> set[str]:
    return {"-".join(h.peer_id for h in c.hops) for c in plan_chains}


def test_a_chains_round_in_the_plan_is_what_routing_charges_a_pushing_chain() -> None:
    servers = sorted(NEAR_FAR, key=lambda s: s.peer_id)
    graph = _graph(servers, RTTS, BLOCKS, WORK)
    request = RouteRequest(1, rtts=RTTS, push=True)
    for first, second in [(0, 1), (0, 3), (2, 1), (2, 3)]:
        a, b = servers[first], servers[second]
        cost = hop_cost(a, 4, request) + hop_cost(b, 4, request, before=a, last=True)
        assert graph.round(Chain(GATEWAY, ((first, 0), (second, 4)))) == pytest.approx(WORK + cost)


def test_below_the_optimum_the_plan_is_the_fastest_chain_and_at_it_the_optimum() -> None:
    swarm = view(*NEAR_FAR)
    optimum = plan_of(swarm, RTTS, {}, MAX_LENGTH, None, WORK)
    assert optimum is not None and not optimum.below_optimum
    assert {"a-b", "c-d"} <= chains_of(optimum.chains)  # KV-bound: every pool carries what it can
    light = plan_of(swarm, RTTS, {}, MAX_LENGTH, optimum.carried / 10, WORK)
    assert light is not None and light.below_optimum
    assert chains_of(light.chains) == {"a-b"}
    busy = plan_of(swarm, RTTS, {}, MAX_LENGTH, optimum.carried, WORK)
    assert busy is not None and not busy.below_optimum


def test_a_gateway_plans_only_the_room_left_and_what_its_own_sessions_hold() -> None:
    full = [record(s.peer_id, s.start, s.end, cache=0, throughput=100.0, next_rtts=dict(s.next_rtts)) for s in NEAR_FAR]
    taken = [full[0], full[1], *NEAR_FAR[2:]]  # a and b full of other gateways' sessions
    plan = plan_of(view(*taken), RTTS, {}, MAX_LENGTH, 1.0, WORK)
    assert plan is not None and chains_of(plan.chains) == {"c-d"}
    ours = plan_of(view(*taken), RTTS, {"a": 5_000, "b": 5_000}, MAX_LENGTH, 1.0, WORK)
    assert ours is not None and chains_of(ours.chains) == {"a-b"}
    assert ours.carried < plan_of(view(*NEAR_FAR), RTTS, {}, MAX_LENGTH, None, WORK).carried  # type: ignore[union-attr]


def test_an_announced_link_prices_the_hop_and_an_excluded_node_is_never_planned() -> None:
    slow_link = [record("a", 0, 4, throughput=100.0, next_rtts={"b": 0.5}), *NEAR_FAR[1:]]  # a to b: 500 ms
    plan = plan_of(view(*slow_link), RTTS, {}, MAX_LENGTH, 1.0, WORK)
    assert plan is not None and plan.below_optimum and "a-b" not in chains_of(plan.chains)
    plan = plan_of(view(*NEAR_FAR), RTTS, {}, MAX_LENGTH, None, WORK, excluded={"b"})
    assert plan is not None and all("b" not in chain for chain in chains_of(plan.chains))
    assert plan_of(view(*NEAR_FAR), RTTS, {}, MAX_LENGTH, None, WORK, excluded={"b", "d"}) is None
