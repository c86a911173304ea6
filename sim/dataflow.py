"""Each tick of the data plane: the decoding sessions' token rates (``dataplane``), their progress, the nodes'
queues; and the max-flow bound of the placement as it is (``flow_bound``)."""

from __future__ import annotations

import numpy as np

from sim import clients
from sim.dataplane import GATEWAY_WORK, Chains, Nodes, solve
from sim.flow_bound import Stage, max_throughput
from sim.hardware import STEP_OVERHEAD
from sim.swarm import SimNode, queue_depth
from sim.world import World

TICK = 1.0  # seconds of virtual time per data-plane step
WARM_ITERATIONS = 12  # fixed-point iterations per tick, starting from the last tick's solution


def tick(world: World) -> float:
    """Advance every decoding session by one tick; returns the decoded tokens/s."""
    nodes = world.node_list
    fixed = np.array([(STEP_OVERHEAD + n.span * n.hw.read_time) * n.slowdown for n in nodes])
    token_time = np.array([n.hw.token_time * n.slowdown for n in nodes])
    order = sorted(world.decoding)
    if not order:
        return 0.0
    parts = [world.decoding[i] for i in order]
    chains = Chains(
        np.repeat(np.arange(len(order)), [len(p[0]) for p in parts]),
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]),
        len(order),
    )
    start = world.at_node
    if start is None or len(start) != len(nodes):
        start = None if start is None else np.concatenate([start, fixed[len(start) :] * 1.5])
    rates = solve(chains, Nodes(fixed, token_time), start, WARM_ITERATIONS if start is not None else 60)
    world.at_node = rates.at_node
    for node, present in zip(nodes, rates.present, strict=True):
        node.queue_depth = queue_depth(float(present))
    for index, rate in zip(order, rates.tokens_per_s, strict=True):
        session = world.sessions[index]
        session.done += rate * TICK
        if session.done >= session.request.output:
            clients.finish(world, session)
    return float(rates.tokens_per_s.sum())


def bound(world: World, mean_length: float) -> tuple[float, float]:
    """(the bound, the bound without the KV limit) for the nodes serving now, in tokens/s.

    A node's part is its full-batch capacity; with the KV limit, at most the sessions its pool holds (pool / mean
    session length), each at most one token per the fastest round any chain through it could make
    (``fastest_rounds``)."""
    serving = world.serving()
    fastest = fastest_rounds(world, serving)
    compute = [Stage(n.start, n.end, n.capacity) for n in serving]
    held = [
        Stage(n.start, n.end, min(n.capacity, n.hw.cache_tokens / mean_length / t))
        for n, t in zip(serving, fastest, strict=True)
    ]
    blocks = world.model.num_blocks
    return max_throughput(held, blocks), max_throughput(compute, blocks)


def fastest_rounds(world: World, serving: list[SimNode]) -> list[float]:
    """Per node, a lower bound on the seconds per token of any chain through it: per block the fastest idle node
    serving it, the gateway's own work, and the round trip from the nearest gateway to this node (the links of a
    chain out to it and back are at least that: the triangle inequality on distances, and both last miles)."""
    if not serving:
        return []
    per_block = np.full(world.model.num_blocks, np.inf)
    for n in serving:
        block = (n.hw.read_time + n.hw.token_time) * n.slowdown
        per_block[n.start : n.end] = np.minimum(per_block[n.start : n.end], block)
    compute = float(np.where(np.isfinite(per_block), per_block, 0.0).sum()) + STEP_OVERHEAD + GATEWAY_WORK
    return [compute + min(world.rtt_to(g.city, 0.0005, n) for g in world.gateways) for n in serving]
