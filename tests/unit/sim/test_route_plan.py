"""A simulated gateway's route plan (``sim.route_plan``): chains drawn in proportion to the plan's sessions and only
where every hop fits (``planned.pick``); the demand a plan is sized by (``DemandMeter``); and the plan made from a
view and what every gateway announces (``view_plan``): its chains' rounds are what ``routing.hop_cost`` charges a
pushing chain, the fastest chains below the optimum, the optimum (KV-bound: more chains) past it, each gateway its
own chains of one plan, and no excluded node."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest

from gateway.swarm.routing import Hop, RouteRequest, hop_cost
from gateway.swarm.view import SwarmView
from shared.server_records import NodeState, ServerRecord
from sim.route_plan.chains import Chain
from sim.route_plan.planned import (
    DEMAND_WINDOW,
    FINISHED_KEPT,
    ROOM_WINDOW,
    DemandMeter,
    NoPlannedRoom,
    PlannedChain,
    pick,
)
from sim.route_plan.view_plan import GatewayDemand, _graph, plan_of
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
    meter.finished(40)
    meter.finished(60)
    assert meter.demand(200.0) == pytest.approx(50.0)  # 1 a second since the first (not over the window) x 50
    assert meter.held_length(200.0) == 2000.0
    for t in range(200, 200 + int(DEMAND_WINDOW), 10):
        meter.opened(500, float(t))  # then one every 10 s
    later = 200 + DEMAND_WINDOW
    assert meter.demand(later) == pytest.approx(29 / DEMAND_WINDOW * 50)  # the first 100 s forgotten, not the lengths
    assert meter.held_length(later) == 500.0
    for _ in range(FINISHED_KEPT):
        meter.finished(20)
    assert meter.demand(later) == pytest.approx(29 / DEMAND_WINDOW * 20)  # the last FINISHED_KEPT only
    assert meter.demand(later + 2 * DEMAND_WINDOW) is None  # nobody came for a whole window


def test_while_a_session_finds_no_room_the_demand_is_the_optimums() -> None:
    meter = DemandMeter()
    for t in range(100):
        meter.opened(1000, float(t))
        meter.finished(10)
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


def alone(demand: float | None = None) -> list[GatewayDemand]:
    return [GatewayDemand(RTTS, demand, MAX_LENGTH)]


def chains_of(plan_chains: tuple[PlannedChain, ...]) -> set[str]:
    return {"-".join(h.peer_id for h in c.hops) for c in plan_chains}


def test_a_chains_round_in_the_plan_is_what_routing_charges_a_pushing_chain() -> None:
    busy = record("e", 2, 8, cache=4_000, throughput=50.0)  # 60 % of its pool in use; entered at 4: 4 of 6 blocks
    servers = sorted([*NEAR_FAR, busy], key=lambda s: s.peer_id)
    rtts = {**RTTS, "e": 0.05}
    graph = _graph(servers, [GatewayDemand(rtts, None, MAX_LENGTH)], 0, BLOCKS, WORK)
    request = RouteRequest(1, rtts=rtts, push=True)
    for first, second in [(0, 1), (0, 3), (2, 1), (2, 3), (0, 4), (2, 4)]:
        a, b = servers[first], servers[second]
        cost = hop_cost(a, 4, request) + hop_cost(b, 4, request, before=a, last=True)
        assert graph.round(Chain(0, ((first, 0), (second, 4)))) == pytest.approx(WORK + cost)
    assert hop_cost(busy, 4, request) == pytest.approx(0.05 / 2 + (4 + 2 * 0.6) * busy.block_time)  # more than 4 blocks


def test_below_the_optimum_the_plan_is_the_fastest_chain_and_at_it_the_optimum() -> None:
    swarm = view(*NEAR_FAR)
    optimum = plan_of(swarm, alone(), 0, WORK)
    assert optimum is not None and not optimum.below_optimum
    assert {"a-b", "c-d"} <= chains_of(optimum.chains)  # KV-bound: every pool carries what it can
    light = plan_of(swarm, alone(optimum.carried / 10), 0, WORK)
    assert light is not None and light.below_optimum
    assert chains_of(light.chains) == {"a-b"}
    busy = plan_of(swarm, alone(optimum.carried), 0, WORK)
    assert busy is not None and not busy.below_optimum


def test_each_gateway_draws_from_its_own_chains_of_one_plan_for_all() -> None:
    """Gateway 0 near a and b, gateway 1 near c and d (and c to d 10 ms): the optimum gives each pool to the
    gateway near it; whole pools, whatever room the records say is left (the plan is for every gateway's
    sessions); a demand plan only once every gateway's demand is known."""
    swarm = [*NEAR_FAR[:2], record("c", 0, 4, cache=0, throughput=100.0, next_rtts={"d": 0.01}), NEAR_FAR[3]]
    near_cd = {"a": 0.2, "b": 0.2, "c": 0.01, "d": 0.01}
    both = [GatewayDemand(RTTS, None, MAX_LENGTH), GatewayDemand(near_cd, None, MAX_LENGTH)]
    plans = [plan_of(view(*swarm), both, me, WORK) for me in (0, 1)]
    assert plans[0] is not None and plans[1] is not None
    assert chains_of(plans[0].chains) == {"a-b"} and chains_of(plans[1].chains) == {"c-d"}
    assert all(c.gateway == me for me, plan in enumerate(plans) for c in plan.chains)  # type: ignore[union-attr]
    assert plans[0].every == plans[1].every  # the same plan from the same inputs
    half_known = [GatewayDemand(RTTS, 1.0, MAX_LENGTH), GatewayDemand(near_cd, None, MAX_LENGTH)]
    assert not plan_of(view(*swarm), half_known, 0, WORK).below_optimum  # type: ignore[union-attr]
    known = [GatewayDemand(RTTS, 1.0, MAX_LENGTH), GatewayDemand(near_cd, 1.0, MAX_LENGTH)]
    assert plan_of(view(*swarm), known, 0, WORK).below_optimum  # type: ignore[union-attr]


def test_an_announced_link_prices_the_hop_and_an_excluded_node_is_never_planned() -> None:
    slow_link = [record("a", 0, 4, throughput=100.0, next_rtts={"b": 0.5}), *NEAR_FAR[1:]]  # a to b: 500 ms
    plan = plan_of(view(*slow_link), alone(1.0), 0, WORK)
    assert plan is not None and plan.below_optimum and "a-b" not in chains_of(plan.chains)
    plan = plan_of(view(*NEAR_FAR), alone(), 0, WORK, excluded={"b"})
    assert plan is not None and all("b" not in chain for chain in chains_of(plan.chains))
    assert plan_of(view(*NEAR_FAR), alone(), 0, WORK, excluded={"b", "d"}) is None
