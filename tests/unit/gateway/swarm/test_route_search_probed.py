"""Routes over swarms whose nodes measured what swarm_node measures: the first servers of their end block by peer id,
so every server ending at a boundary measured the same next hops (each of those legs is entered only by the links
measured to it), and with every third server silent (none measured yet: the leg's own link from those)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gateway.swarm.routing import RouteRequest, RoutingMode, plan_route
from gateway.swarm.view import SwarmView
from shared.server_records import ServerRecord
from tests.unit.gateway.swarm.test_route_search import random_swarm, reference_cost, route_cost, tied

NEXT_HOPS_PROBED = 4  # swarm_node.server's


def probed(rng: random.Random, view: SwarmView, some_silent: bool) -> SwarmView:
    """The view with each server's round trips to the first servers of its end block, as swarm_node probes them."""
    ordered = sorted(view.servers.values(), key=lambda s: s.peer_id)
    records: dict[str, ServerRecord] = {}
    for server in ordered:
        nexts = [s for s in ordered if s.start <= server.end < s.end][:NEXT_HOPS_PROBED]
        rtts = {s.peer_id: round(rng.uniform(0.001, 0.2), 3) for s in nexts}
        if some_silent and len(records) % 3 == 0:
            rtts = {}
        records[server.peer_id] = server.model_copy(update={"next_rtts": rtts})
    return SwarmView(view.num_blocks, records)


@pytest.mark.parametrize("some_silent", [False, True])
def test_routes_over_probed_next_hops_are_as_cheap_as_dijkstra(some_silent: bool) -> None:
    rng = random.Random(5)
    for _ in range(120):
        view = probed(rng, random_swarm(rng, rng.randint(10, 60), rng.randint(6, 30)), some_silent)
        peers = sorted(view.servers)
        rtts = {p: round(rng.uniform(0.002, 0.2), 3) for p in peers}
        banned = frozenset(p for p in peers if rng.random() < 0.1)
        request = RouteRequest(1000, rtts=rtts, banned=banned, push=True)
        assert route_cost(view, request) == pytest.approx(reference_cost(view, request), rel=1e-9, abs=1e-12)


def golden_cases() -> list[tuple[SwarmView, RouteRequest]]:
    """Probed swarms, every other one of few distinct speeds and round trips (many equal costs)."""
    rng = random.Random(13)
    cases = []
    for i in range(200):
        view = probed(rng, random_swarm(rng, rng.randint(10, 60), rng.randint(6, 30)), i % 3 == 0)
        peers = sorted(view.servers)
        rtts = {p: round(rng.uniform(0.002, 0.2), 3) for p in peers}
        if i % 2:
            view = SwarmView(view.num_blocks, {p: tied(rng, s) for p, s in view.servers.items()})
            rtts = {p: rng.choice([0.01, 0.02]) if i % 4 == 1 else 0.02 for p in peers}  # 0.02: as every link
        banned = frozenset(p for p in peers if rng.random() < 0.1)
        start = rng.randint(0, view.num_blocks - 1) if rng.random() < 0.3 else 0
        cases.append((view, RouteRequest(1000, start, rtts=rtts, banned=banned, push=True)))
    return cases


def test_the_search_chooses_the_hops_it_chose_before_over_probed_links() -> None:
    """data/probed_route_hops.json: the hops the search chose on these swarms when it became scipy's Dijkstra, ties
    included (the dynamic programme before it chose other hops of the same cost on 22 of the 200)."""
    expected = json.loads((Path(__file__).parent / "data" / "probed_route_hops.json").read_text())
    chosen = [
        [[h.peer_id, h.start, h.end] for h in plan_route(view, request, RoutingMode.MIN_LATENCY)]
        for view, request in golden_cases()
    ]
    assert chosen == expected


def test_a_measured_link_never_leads_into_an_excluded_server() -> None:
    """Excluded servers stay in the view's table (not enterable): a link measured to one is never priced."""
    rng = random.Random(17)
    for _ in range(80):
        view = probed(rng, random_swarm(rng, rng.randint(10, 60), rng.randint(6, 30)), False)
        peers = sorted(view.servers)
        excluded = frozenset(p for p in peers[len(peers) // 3 :] if rng.random() < 0.2)  # the first chain stays
        rtts = {p: round(rng.uniform(0.002, 0.2), 3) for p in peers}
        request = RouteRequest(1000, rtts=rtts, excluded=excluded, push=True)
        hops = plan_route(view, request, RoutingMode.MIN_LATENCY)
        assert not {h.peer_id for h in hops} & excluded
        trusted = SwarmView(view.num_blocks, {p: s for p, s in view.servers.items() if p not in excluded})
        assert route_cost(view, request) == pytest.approx(reference_cost(trusted, request), rel=1e-9, abs=1e-12)
