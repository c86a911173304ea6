"""Route choice's cost by swarm size: the real ``plan_route`` (push, min_latency: the gateway's defaults) timed on
a settled swarm of N simulated nodes (placed by our span choice, no traffic), from each gateway in turn: as the
simulator's nodes announce (no measured next hops), and as swarm_node's do (``next_rtts`` to the first
``NEXT_HOPS_PROBED`` servers of its end block by peer id), which makes the search price those links one by one.

``python -m sim.route_timing [--nodes N ...]`` times only this (no scenarios) and prints the table."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from gateway.swarm.routing import RouteRequest, RoutingMode, plan_route
from gateway.swarm.view import SwarmView
from sim.hardware import LLAMA_405B, ModelShape
from sim.scenario import JOIN_WINDOW, Scenario, settle
from sim.world import GATEWAY_LAST_MILE, World

CALLS = 300  # enough for a p99 that is not just the slowest call (the first on a view also builds its table)
NEXT_HOPS_PROBED = 4  # swarm_node.server's


def time_routes(model: ModelShape, nodes: int, seed: int = 1) -> tuple[list[float], list[float]]:
    """Seconds per ``plan_route`` call, ``CALLS`` calls: without measured next hops, and with them."""
    world = settle(replace(Scenario("routes", model=model, nodes=nodes, seed=seed, churn=False)), JOIN_WINDOW + 150)
    view = world.dht.view(world.clock.now)
    return _timed(world, view), _timed(world, with_next_hops(world, view))


def with_next_hops(world: World, view: SwarmView) -> SwarmView:
    """The view's records with the next-hop round trips a real node would announce."""
    ordered = sorted(view.servers.values(), key=lambda s: s.peer_id)
    records = {}
    for server in ordered:
        nexts = [s for s in ordered if s.start <= server.end < s.end and s is not server][:NEXT_HOPS_PROBED]
        me = world.nodes[server.peer_id]
        rtts = {s.peer_id: world.rtt_between(me, world.nodes[s.peer_id]) for s in nexts}
        records[server.peer_id] = server.model_copy(update={"next_rtts": rtts})
    return SwarmView(view.num_blocks, records, view.fetched_at)


def _timed(world: World, view: SwarmView) -> list[float]:
    times = []
    for call in range(CALLS):
        gateway = world.gateways[call % len(world.gateways)]
        rtts = {peer: world.rtt_to(gateway.city, GATEWAY_LAST_MILE, world.nodes[peer]) for peer in view.servers}
        request = RouteRequest(1024, rtts=rtts, push=True)
        began = time.process_time()
        plan_route(view, request, RoutingMode.MIN_LATENCY)
        times.append(time.process_time() - began)
    return times


def table(times: dict[int, tuple[list[float], list[float]]]) -> list[str]:
    """Markdown rows: p50 and p99 in ms per size, without next hops and with them."""
    rows = ["| nodes | calls | p50 ms | p99 ms | with next hops: p50 ms | p99 ms |", "|---|---|---|---|---|---|"]
    for nodes, (plain, linked) in sorted(times.items()):
        a, b = np.array(plain) * 1e3, np.array(linked) * 1e3
        rows.append(
            f"| {nodes} | {len(a)} | {np.median(a):.2f} | {np.percentile(a, 99):.2f} | {np.median(b):.2f}"
            f" | {np.percentile(b, 99):.2f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sim.route_timing", description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 300, 1000], help="swarm sizes to time")
    parser.add_argument("--seed", type=int, default=1, help="the settled swarm's seed (python -m sim uses 1)")
    args = parser.parse_args()
    times = {n: time_routes(LLAMA_405B, n, args.seed) for n in args.nodes}
    print("\n".join(table(times)))  # noqa: T201


if __name__ == "__main__":
    main()
