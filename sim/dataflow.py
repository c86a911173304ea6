"""Each tick of the data plane: the decoding sessions' token rates (``dataplane``), their progress, the nodes'
queues; and the max-flow bound of the placement as it is (``flow_bound``)."""

from __future__ import annotations

import numpy as np

from gateway.swarm.routing import Hop
from sim import clients, fastest_chain
from sim.dataplane import GATEWAY_WORK, LEAST_WAIT, Chains, Nodes, solve
from sim.flow_bound import Stage, max_throughput
from sim.hardware import STEP_OVERHEAD
from sim.route_plan.chains import Chain
from sim.route_plan.path_lp import PathBound, path_bound
from sim.route_plan.planned import PlannedChain
from sim.swarm import SimNode, queue_depth
from sim.world import GATEWAY_LAST_MILE, World

TICK = 1.0  # seconds of virtual time per data-plane step


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
    rates = solve(chains, Nodes(fixed, token_time), start)
    world.at_node = rates.at_node
    for node, present in zip(nodes, rates.present, strict=True):
        node.queue_depth = queue_depth(float(present))
    for index, rate in zip(order, rates.tokens_per_s, strict=True):
        session = world.sessions[index]
        session.done += rate * TICK
        if session.done >= session.request.output:
            clients.finish(world, session)
    return float(rates.tokens_per_s.sum())


def bound(world: World, held_length: float) -> tuple[float, float]:
    """(the bound, the bound without the KV limit) for the nodes that may decode now (``World.carrying``), tokens/s.

    A node's part is its full-batch capacity; with the KV limit, at most its pool x the fastest rate any chain
    through it could give one session (``fastest_chain``) / ``held_length`` (``workload.mean_request``: the KV
    tokens a decoded token holds per second)."""
    serving = world.carrying()
    rounds = fastest_rounds(world, serving)
    compute = [Stage(n.start, n.end, n.capacity) for n in serving]
    held = [
        Stage(n.start, n.end, min(n.capacity, n.hw.cache_tokens / held_length / t))
        for n, t in zip(serving, rounds, strict=True)
    ]
    blocks = world.model.num_blocks
    return max_throughput(held, blocks), max_throughput(compute, blocks)


def fastest_rounds(world: World, serving: list[SimNode]) -> list[float]:
    """Per node, a lower bound on the seconds per token of any chain through it (``fastest_chain``: its links,
    and per hop what ``dataplane.solve`` charges a token at least: the step under way and its own, ``LEAST_WAIT``
    steps of the span's weight reads) plus the gateway's own work."""
    if not serving:
        return []
    placement = fastest_chain.Placement(
        np.array([n.start for n in serving], dtype=np.int64),
        np.array([n.end for n in serving], dtype=np.int64),
        np.array([fastest_chain.CITY_INDEX[n.city.name] for n in serving], dtype=np.int64),
        np.array([n.last_mile for n in serving]),
        LEAST_WAIT * np.array([(STEP_OVERHEAD + n.span * n.hw.read_time) * n.slowdown for n in serving]),
        np.zeros(len(serving)),  # a step's rows may be fewer than one on average (Little's law): count none
    )
    gateways = [(g.city, GATEWAY_LAST_MILE) for g in world.gateways]
    rounds = fastest_chain.fastest_rounds(placement, gateways, world.model.num_blocks) + GATEWAY_WORK
    return [float(r) for r in rounds]


def path(world: World, held_length: float, seconds: float = 60.0) -> PathBound | None:
    """The path LP's bound for the nodes that may decode now (``World.carrying``; ``path_bound``: never above
    ``bound``'s first figure); None where its pricing gave up, and then the per-node figure is the bound."""
    serving = [n for n in world.carrying() if n.capacity > 0 and n.hw.cache_tokens > 0]
    if not serving:
        return PathBound(0.0, 0.0, 0, 0, True)
    fixed = np.array([(STEP_OVERHEAD + n.span * n.hw.read_time) * n.slowdown for n in serving])
    placement = fastest_chain.Placement(
        np.array([n.start for n in serving], dtype=np.int64),
        np.array([n.end for n in serving], dtype=np.int64),
        np.array([fastest_chain.CITY_INDEX[n.city.name] for n in serving], dtype=np.int64),
        np.array([n.last_mile for n in serving]),
        LEAST_WAIT * fixed,  # as ``fastest_rounds``: the least a token spends at a node
        np.zeros(len(serving)),
    )
    gateways = tuple((fastest_chain.CITY_INDEX[g.city.name], GATEWAY_LAST_MILE) for g in world.gateways)
    graph = fastest_chain.chain_graph(placement, gateways, world.model.num_blocks, GATEWAY_WORK)
    capacity = np.array([n.capacity for n in serving])
    pool = np.array([float(n.hw.cache_tokens) for n in serving])
    row = {n.peer_id: i for i, n in enumerate(serving)}
    gateway_of = {id(g): i for i, g in enumerate(world.gateways)}
    # A warm start: the last bound's chains, and the chains sessions decode on now, which put every node in use in
    # the first restricted LP (from the fastest chains alone most nodes start out of it, their duals 0, and a chain
    # through such nodes prices at 0: no bound until they are in). The bound is the same either way; the iterations
    # fewer (bench/README.md, stop 51).
    ours = ((gateway_of[id(world.sessions[i].gateway)], world.sessions[i].hops) for i in sorted(world.decoding))
    start = tuple(
        dict.fromkeys(
            Chain(g, tuple((row[hop.peer_id], hop.start) for hop in hops))
            for g, hops in [*((c.gateway, c.hops) for c in world.bound_chains), *ours]
            if all(hop.peer_id in row for hop in hops)
        )
    )
    found = path_bound(graph, capacity, pool, held_length, seconds, start=start)
    if found is None:
        return None

    def by_peer(chains: tuple[Chain, ...], rates: tuple[float, ...]) -> list[PlannedChain]:  # rows change
        return [
            PlannedChain(c.gateway, tuple(Hop(serving[n].peer_id, e, serving[n].end) for n, e in c.hops), y * round_)
            for c, y in zip(chains, rates, strict=True)
            for round_ in [graph.round(c)]
        ]

    world.bound_chains = by_peer(found.used, found.rates)
    return found
