"""The array route search finds routes exactly as cheap as the plain Dijkstra it replaced, on random swarms with
pushing, measured links, bans, cache-short nodes and unmeasured ones."""

from __future__ import annotations

import heapq
import random

import pytest

from gateway.swarm.routing import RouteRequest, RoutingMode, hop_cost, plan_route
from gateway.swarm.view import SwarmView
from shared.server_records import NodeState, ServerRecord


def reference_cost(view: SwarmView, request: RouteRequest) -> float:
    """The cheapest route's cost by the search routing used before: Dijkstra over (boundary, last server)."""
    servers = {s.peer_id: s for s in view.online()}
    best: dict[tuple[int, str], float] = {(0, ""): 0.0}
    queue = [(0.0, 0, "")]
    while queue:
        cost, block, before = heapq.heappop(queue)
        if block == view.num_blocks:
            return cost
        if cost > best[(block, before)]:
            continue
        here = view.servers_for(block)
        allowed = [s for s in here if s.peer_id not in request.banned] or here
        for server in allowed:
            reach = server.end
            total = cost + hop_cost(server, reach - block, request, servers.get(before), reach == view.num_blocks)
            state = (reach, server.peer_id if request.push else "")
            if total < best.get(state, float("inf")):
                best[state] = total
                heapq.heappush(queue, (total, *state))
    raise AssertionError("no route")


def route_cost(view: SwarmView, request: RouteRequest) -> float:
    hops = plan_route(view, request, RoutingMode.MIN_LATENCY)
    assert [h.start for h in hops[1:]] == [h.end for h in hops[:-1]] and hops[-1].end == view.num_blocks
    total, before = 0.0, None
    for i, hop in enumerate(hops):
        server = view.servers[hop.peer_id]
        assert server.start <= hop.start < hop.end <= server.end
        total += hop_cost(server, hop.end - hop.start, request, before, i == len(hops) - 1)
        before = server
    return total


def random_swarm(rng: random.Random, nodes: int, blocks: int) -> SwarmView:
    spans = []
    covered = 0
    while covered < blocks:  # a chain that covers every block, then spans anywhere
        span = min(rng.randint(2, 8), blocks - covered)
        spans.append((covered, covered + span))
        covered += span
    for _ in range(nodes):
        span = rng.randint(2, min(8, blocks))
        start = rng.randint(0, blocks - span)
        spans.append((start, start + span))
    records = {}
    for i, (start, end) in enumerate(spans):
        peer = f"p{i:03d}"
        links = {f"p{rng.randrange(len(spans)):03d}": rng.uniform(0.001, 0.3) for _ in range(rng.randint(0, 4))}
        records[peer] = ServerRecord(
            peer_id=peer, start=start, end=end, state=NodeState.ONLINE,
            throughput=rng.choice([0.0, rng.uniform(2, 60)]), cache_tokens_left=rng.choice([100, 10_000]),
            next_rtts=links, version="t", protocol=1,
        )  # fmt: skip
    return SwarmView(blocks, records)


@pytest.mark.parametrize("push", [False, True])
def test_the_array_search_finds_routes_as_cheap_as_dijkstra(push: bool) -> None:
    rng = random.Random(7)
    for _ in range(150):
        view = random_swarm(rng, rng.randint(3, 40), rng.randint(4, 24))
        peers = sorted(view.servers)
        rtts = {p: rng.uniform(0.002, 0.2) for p in peers if rng.random() < 0.8}
        banned = frozenset(p for p in peers if rng.random() < 0.15)
        request = RouteRequest(1000, rtts=rtts, banned=banned, push=push)
        assert route_cost(view, request) == pytest.approx(reference_cost(view, request), rel=1e-9, abs=1e-12)
