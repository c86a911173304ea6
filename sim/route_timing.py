"""Route choice's cost by swarm size: the real ``plan_route`` (push, min_latency: the gateway's defaults) timed on
a settled swarm of N simulated nodes (placed by our span choice, no traffic), from each gateway in turn."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from gateway.swarm.routing import RouteRequest, RoutingMode, plan_route
from sim.hardware import ModelShape
from sim.scenario import JOIN_WINDOW, Scenario, settle
from sim.world import GATEWAY_LAST_MILE

CALLS = 60


def time_routes(model: ModelShape, nodes: int, seed: int = 1) -> list[float]:
    """Seconds per ``plan_route`` call, ``CALLS`` calls."""
    world = settle(replace(Scenario("routes", model=model, nodes=nodes, seed=seed, churn=False)), JOIN_WINDOW + 150)
    view = world.dht.view(world.clock.now)
    times = []
    for call in range(CALLS):
        gateway = world.gateways[call % len(world.gateways)]
        rtts = {peer: world.rtt_to(gateway.city, GATEWAY_LAST_MILE, world.nodes[peer]) for peer in view.servers}
        request = RouteRequest(1024, rtts=rtts, push=True)
        began = time.process_time()
        plan_route(view, request, RoutingMode.MIN_LATENCY)
        times.append(time.process_time() - began)
    return times


def percentiles(times: list[float]) -> tuple[float, float]:
    ms = np.array(times) * 1e3
    return float(np.median(ms)), float(np.percentile(ms, 99))
