"""The plan a simulated gateway routes its users' whole chains by (``--planned-routing``; the gateway's router does
not: ``bench/README.md``, stop 43): one path LP over the swarm for every gateway that announces
its demand, each gateway drawing from its own chains of it (issue 27).

A plan over one gateway's part of the pools re-plans the chains that gateway already holds once the swarm is full
(``bench/README.md``, stop 43); the optimum gives each pool to the gateways near it, and only a plan over all of
them knows which. So every gateway solves the same LP from the same inputs: the view's records (spans;
``throughput``, one session's tokens/s through a span, and a hop's step as ``routing.hop_cost`` prices it, which
counts the whole span's step on a busy node however few of its blocks the hop uses; whole pools),
the nodes' announced ``next_rtts`` (between hops; where none is announced, the planning gateway's own RTT to the
next node, as ``routing.hop_cost`` reads links) and, per gateway, what it announces (``GatewayDemand``): its RTTs
to the nodes (to a first hop and back from a last) and its users' demand. No compute rows: a record says one
session's speed, not what a full batch carries.

As ``planned`` says: where every gateway's demand is measured and ``DEMAND_MARGIN`` x their sum is below what the
LP carries, the fastest plan for those demands (a session with no planned room goes by ``plan_route``); else the
optimum's plan (a session waits for room on it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gateway.swarm.routing import UNKNOWN_RTT, Hop
from gateway.swarm.view import SwarmView
from shared.server_records import ServerRecord
from sim.route_plan.chains import Chain, Graph, Spans
from sim.route_plan.path_lp import fastest_plan, path_bound
from sim.route_plan.planned import DEMAND_MARGIN, PlannedChain


@dataclass(frozen=True)
class GatewayDemand:
    """What a gateway tells the others for their plans: its RTTs to nodes, its users' demand (tokens/s; None: not
    measured yet) and the mean ``max_length`` of their sessions (``planned.DemandMeter``)."""

    rtts: Mapping[str, float]
    demand: float | None
    held_length: float


@dataclass(frozen=True)
class RoutePlan:
    chains: tuple[PlannedChain, ...]  # this gateway's chains to draw from (``planned.pick``), with their sessions
    below_optimum: bool  # a demand plan: a session that finds no planned room goes by ``plan_route``
    carried: float  # tokens/s the LP's optimum carries for every gateway at once
    every: tuple[PlannedChain, ...] = ()  # every gateway's chains (the next plan's warm start)


def plan_of(
    view: SwarmView,
    gateways: Sequence[GatewayDemand],
    me: int,
    work: float,
    excluded: Collection[str] = (),
    previous: Sequence[PlannedChain] = (),
    seconds: float = 5.0,
) -> RoutePlan | None:
    """Gateway ``gateways[me]``'s plan; ``work``: a gateway's own seconds per token; ``excluded``: nodes never routed
    (``verify``); ``previous``: the last plan's chains (every gateway's), a warm start. None where the LP's pricing
    gave up or no chain covers every block."""
    servers = sorted(
        (
            s
            for s in view.online()
            if s.peer_id not in excluded and s.throughput > 0 and s.cache_tokens_total > 0 and s.end <= view.num_blocks
        ),
        key=lambda s: s.peer_id,
    )
    if not servers:
        return None
    graph = _graph(servers, gateways, me, view.num_blocks, work)
    pool = np.array([s.cache_tokens_total for s in servers], dtype=float)
    capacity = np.full(len(servers), np.inf)  # no compute rows (the module's docstring)
    demands = [g.demand for g in gateways]
    known = [d for d in demands if d is not None]
    # One length for the LP's KV rows: the gateways' lengths weighted by their demand (equally before any is known).
    weights = np.array([d or 0.0 for d in demands]) if sum(known) > 0 else np.ones(len(gateways))
    held_length = float(np.average([g.held_length for g in gateways], weights=weights))
    row = {s.peer_id: i for i, s in enumerate(servers)}
    start = tuple(
        Chain(c.gateway, tuple((row[hop.peer_id], hop.start) for hop in c.hops))
        for c in previous
        if c.gateway < len(gateways) and all(hop.peer_id in row for hop in c.hops)
    )
    found = path_bound(graph, capacity, pool, held_length, seconds, start=start)
    if found is None or found.reached <= 0:
        return None
    below = len(known) == len(demands) and DEMAND_MARGIN * sum(known) < found.reached
    if below:
        wanted = DEMAND_MARGIN * np.array(known)
        chains, rates = fastest_plan(graph, capacity, pool, held_length, found.known, wanted)
    else:
        chains, rates = found.used, found.rates
    planned = tuple(
        PlannedChain(
            c.gateway, tuple(Hop(servers[n].peer_id, e, servers[n].end) for n, e in c.hops), y * graph.round(c)
        )
        for c, y in zip(chains, rates, strict=True)
    )
    return RoutePlan(tuple(c for c in planned if c.gateway == me), below, found.reached, planned)


def _graph(servers: list[ServerRecord], gateways: Sequence[GatewayDemand], me: int, blocks: int, work: float) -> Graph:
    peers = [s.peer_id for s in servers]
    legs = np.array([[g.rtts.get(p, UNKNOWN_RTT) for p in peers] for g in gateways]) / 2  # one way, gateway-node
    links = np.tile(legs[me], (len(servers), 1))  # [from, to]: what the sender announced, else our own RTT
    row = {p: i for i, p in enumerate(peers)}
    for i, server in enumerate(servers):
        for peer, rtt in server.next_rtts.items():
            if peer in row:
                links[i, row[peer]] = rtt / 2
    spans = Spans(
        np.array([s.start for s in servers], dtype=np.int64),
        np.array([s.end for s in servers], dtype=np.int64),
        np.array([s.occupancy / s.throughput for s in servers]),  # as routing's legs: see hop_cost
        np.array([s.block_time * (1.0 - s.occupancy) for s in servers]),
    )
    return Graph.of(spans, links, legs, blocks, work)
