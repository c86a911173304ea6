"""Planned routing (``route_plan.planned``): a session goes only on a chain of the path LP's plan with room on every
hop, drawn in proportion to the plan's sessions, and waits where none has room, except on a plan sized to a demand
below the optimum, where ``plan_route`` routes it; and a simulated run with it routes every decoding session over
every block."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import gateway.swarm.route_plan.planned
import sim.world
from gateway.swarm.route_plan.planned import DEMAND_WINDOW, NoPlannedRoom, PlannedChain, offered_load, pick
from gateway.swarm.routing import Hop, RouteRequest, RoutingMode, plan_route
from gateway.swarm.view import SwarmView
from shared.server_records import NodeState, ServerRecord
from sim.hardware import LLAMA_70B
from sim.scenario import Scenario, run, settle
from sim.workload import Request
from sim.world import Session

BLOCKS = 8
MAX_LENGTH = 1000


def record(peer: str, start: int, end: int, room: int = 10_000, state: NodeState = NodeState.ONLINE) -> ServerRecord:
    return ServerRecord(
        peer_id=peer, start=start, end=end, state=state, cache_tokens_left=room, version="test", protocol=1
    )


def view(*records: ServerRecord) -> SwarmView:
    return SwarmView(BLOCKS, {r.peer_id: r for r in records})


# Two chains from gateway 0 (a-b and c-d), one from gateway 1 (a-d, entering d mid-span).
PLAN = [
    PlannedChain(0, (Hop("a", 0, 4), Hop("b", 4, 8)), sessions=3.0),
    PlannedChain(0, (Hop("c", 0, 2), Hop("d", 2, 8)), sessions=1.0),
    PlannedChain(1, (Hop("a", 0, 4), Hop("d", 4, 8)), sessions=5.0),
]
SWARM = [record("a", 0, 4), record("b", 4, 8), record("c", 0, 2), record("d", 2, 8)]


def picks(swarm: list[ServerRecord], request: RouteRequest, gateway: int = 0, draws: int = 4000) -> Counter[str]:
    rng = np.random.default_rng(0)
    return Counter("-".join(h.peer_id for h in pick(PLAN, gateway, view(*swarm), request, rng)) for _ in range(draws))


def test_chains_are_drawn_in_proportion_to_the_plans_sessions_from_the_sessions_own_gateway() -> None:
    drawn = picks(SWARM, RouteRequest(MAX_LENGTH))
    assert set(drawn) == {"a-b", "c-d"}
    assert drawn["a-b"] / 4000 == pytest.approx(0.75, abs=0.02)  # 3 standard deviations
    assert picks(SWARM, RouteRequest(MAX_LENGTH), gateway=1) == Counter({"a-d": 4000})


@pytest.mark.parametrize(
    ("swarm", "request_", "left"),
    [
        ([record("b", 4, 8, room=MAX_LENGTH - 1), *SWARM[2:], SWARM[0]], RouteRequest(MAX_LENGTH), {"c-d"}),
        (SWARM, RouteRequest(MAX_LENGTH, room_left={"a": 10}), {"c-d"}),
        (SWARM, RouteRequest(MAX_LENGTH, banned=frozenset({"d"})), {"a-b"}),
        (
            [SWARM[0], SWARM[1], SWARM[2], record("d", 2, 8, state=NodeState.DRAINING)],
            RouteRequest(MAX_LENGTH),
            {"a-b"},
        ),
        ([SWARM[0], SWARM[1], SWARM[2], record("d", 3, 8)], RouteRequest(MAX_LENGTH), {"a-b"}),  # d moved
        ([SWARM[0], SWARM[2], SWARM[3]], RouteRequest(MAX_LENGTH), {"c-d"}),  # b gone
    ],
    ids=["record short of room", "refused since", "banned", "draining", "moved", "gone"],
)
def test_a_chain_with_any_hop_unfit_is_never_drawn(
    swarm: list[ServerRecord], request_: RouteRequest, left: set[str]
) -> None:
    assert set(picks(swarm, request_, draws=200)) == left


def test_with_no_planned_chain_fit_the_session_waits_rather_than_take_another() -> None:
    with pytest.raises(NoPlannedRoom):
        pick(PLAN, 0, view(*SWARM), RouteRequest(MAX_LENGTH, banned=frozenset({"a", "c"})), np.random.default_rng(0))


def test_a_planned_run_opens_whole_chains_only_by_the_plan_once_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small 70B run with planned routing: once the first plan is made, no whole chain is opened by ``plan_route``
    (failover patches still are), and sessions decode and finish."""
    calls: list[str] = []
    real_pick = gateway.swarm.route_plan.planned.pick

    def picking(*args: Any, **kwargs: Any) -> list[Hop]:
        calls.append("plan")
        return real_pick(*args, **kwargs)

    def routing(view: SwarmView, request: RouteRequest, mode: RoutingMode) -> list[Hop]:
        whole = request.start == 0 and request.end in (None, view.num_blocks)
        calls.append("plan_route whole" if whole else "plan_route part")
        return plan_route(view, request, mode)

    monkeypatch.setattr(gateway.swarm.route_plan.planned, "pick", picking)
    monkeypatch.setattr(sim.world, "plan_route", routing)
    scenario = replace(
        Scenario("planned", model=LLAMA_70B, nodes=30, load=1.2, churn=False, planned_routing=True).quick(),
        duration=240.0,
        measure_from=180.0,
    )
    result = run(scenario)
    assert "plan" in calls
    assert "plan_route whole" not in calls[calls.index("plan") :]
    assert result.metrics.finished > 0 and max(result.metrics.throughput) > 0


def test_on_a_demand_plan_a_session_with_no_planned_room_goes_by_plan_route_and_on_the_optimum_waits() -> None:
    world = settle(Scenario("planned", model=LLAMA_70B, nodes=30, churn=False, planned_routing=True).quick(), 150.0)
    blocks = world.model.num_blocks
    gateway = world.gateways[0]
    session = Session(0, gateway, Request(prompt=200, output=300), 150.0)
    full = [PlannedChain(0, (Hop("gone", 0, blocks),), sessions=1.0)]  # no node of the swarm: never fits
    world.route_plan = full
    with pytest.raises(NoPlannedRoom):
        gateway.route(session, 0, blocks, frozenset(), fresh=False)
    world.demand_plan = full
    hops = gateway.route(session, 0, blocks, frozenset(), fresh=False)
    assert hops[0].start == 0 and hops[-1].end == blocks
    assert all(a.end == b.start for a, b in zip(hops, hops[1:], strict=False))
    assert all(hop.peer_id in world.nodes for hop in hops)
    # The demand plan is what a session is drawn from where it has room, not the optimum's plan.
    other = gateway.route(session, 0, blocks, frozenset({hops[0].peer_id}), fresh=False)
    assert other != hops
    world.route_plan = [PlannedChain(0, tuple(hops), sessions=1.0)]
    world.demand_plan = [PlannedChain(0, tuple(other), sessions=1.0)]
    assert gateway.route(session, 0, blocks, frozenset(), fresh=False) == other


def test_a_plan_is_sized_by_the_mean_offered_load_over_its_window_since_the_traffic_started() -> None:
    # Samples every 15 s: nothing offered until 120 s, then 100 tok/s with a burst of 400 at 300 s.
    times = [15.0 * i for i in range(1, 41)]  # 15 .. 600 s
    offered = [0.0 if t < 120 else 400.0 if t == 300 else 100.0 for t in times]
    assert offered_load(times[:7], offered[:7], 105.0) is None  # no traffic yet
    since = [o for t, o in zip(times, offered, strict=True) if 120 <= t <= 300]
    assert offered_load(times[:20], offered[:20], 300.0) == pytest.approx(sum(since) / len(since))  # zeros left out
    inside = [o for t, o in zip(times, offered, strict=True) if 600 - DEMAND_WINDOW < t <= 600]
    assert offered_load(times, offered, 600.0) == pytest.approx(sum(inside) / len(inside))  # the burst averaged
    assert offered_load(times, offered, 600.0 + DEMAND_WINDOW) is None  # every sample older than the window
