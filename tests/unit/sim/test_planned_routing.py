"""Planned routing in the simulator: each gateway routes whole chains by its plan (``route_plan.view_plan``); a
session with no planned room waits on the optimum's plan and goes by ``plan_route`` on a demand plan; a run with
it routes every decoding session over every block (``pick`` itself: ``tests/unit/sim/test_route_plan.py``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import sim.route_plan.planned
import sim.world
from gateway.swarm.routing import Hop, RouteRequest, RoutingMode, plan_route
from gateway.swarm.view import SwarmView
from sim.hardware import LLAMA_70B
from sim.route_plan.planned import PLAN_PERIOD, DemandMeter, NoPlannedRoom, PlannedChain
from sim.route_plan.view_plan import RoutePlan
from sim.scenario import Scenario, run, settle
from sim.workload import Request
from sim.world import Session


def test_a_planned_run_opens_whole_chains_only_by_the_plan_once_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small 70B run with planned routing on the optimum's plans (no demand measured): once the first plan is made,
    no whole chain is opened by ``plan_route`` (failover patches still are), and sessions decode and finish."""
    calls: list[str] = []
    real_pick = sim.route_plan.planned.pick

    def picking(*args: Any, **kwargs: Any) -> list[Hop]:
        calls.append("plan")
        return real_pick(*args, **kwargs)

    def routing(view: SwarmView, request: RouteRequest, mode: RoutingMode) -> list[Hop]:
        whole = request.start == 0 and request.end in (None, view.num_blocks)
        calls.append("plan_route whole" if whole else "plan_route part")
        return plan_route(view, request, mode)

    monkeypatch.setattr(sim.route_plan.planned, "pick", picking)
    monkeypatch.setattr(sim.world, "plan_route", routing)
    monkeypatch.setattr(DemandMeter, "demand", lambda _meter, _now: None)
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

    def planned(chains: list[PlannedChain], below_optimum: bool) -> None:
        gateway.plan = RoutePlan(tuple(chains), below_optimum, carried=1.0)
        gateway._planned_at = world.clock.now  # made now: kept for PLAN_PERIOD

    full = [PlannedChain(0, (Hop("gone", 0, blocks),), sessions=1.0)]  # no node of the swarm: never fits
    planned(full, below_optimum=False)
    with pytest.raises(NoPlannedRoom):
        gateway.route(session, 0, blocks, frozenset(), fresh=False)
    planned(full, below_optimum=True)
    hops = gateway.route(session, 0, blocks, frozenset(), fresh=False)
    assert hops[0].start == 0 and hops[-1].end == blocks
    assert all(a.end == b.start for a, b in zip(hops, hops[1:], strict=False))
    assert all(hop.peer_id in world.nodes for hop in hops)
    other = gateway.route(session, 0, blocks, frozenset({hops[0].peer_id}), fresh=False)
    planned([PlannedChain(0, tuple(other), sessions=1.0)], below_optimum=True)
    assert gateway.route(session, 0, blocks, frozenset(), fresh=False) == other  # the plan's, where it has room


def test_a_gateways_plan_is_remade_from_its_view_every_plan_period() -> None:
    world = settle(Scenario("planned", model=LLAMA_70B, nodes=30, churn=False, planned_routing=True).quick(), 150.0)
    blocks = world.model.num_blocks
    gateway = world.gateways[0]
    session = Session(0, gateway, Request(prompt=200, output=300), 150.0)
    hops = gateway.route(session, 0, blocks, frozenset(), fresh=False)
    first = gateway.plan
    assert first is not None and not first.below_optimum  # nothing decoded yet: the optimum
    assert tuple(hops) in {c.hops for c in first.chains}
    assert all(hop.peer_id in world.nodes for c in first.chains for hop in c.hops)
    gateway.route(session, 0, blocks, frozenset(), fresh=False)
    assert gateway.plan is first and len(world.plan_times) == 1
    for each in world.gateways:  # one session a plan period at every gateway, 10 tokens: far below the optimum
        each.meter.opened(1000, world.clock.now)
        each.meter.finished(10)
    world.clock.run_until(world.clock.now + PLAN_PERIOD)
    gateway.route(session, 0, blocks, frozenset(), fresh=False)
    assert gateway.plan is not first and gateway.plan is not None and gateway.plan.below_optimum
