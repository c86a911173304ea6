"""The plan one gateway routes its users' whole chains by, made from what that gateway sees (issue 27).

Everything here is what a gateway has: the view's records (spans; ``throughput``, one session's tokens/s through a
span, so a hop's step is ``blocks x block_time``; pools), its measured RTTs (to a first hop and back from a last
one) and the nodes' announced ``next_rtts`` (between hops; the gateway's own RTT to the next node where none is
announced), read as ``routing.hop_cost`` reads them for a pushing chain. Over chains from this gateway alone it
solves the path LP (``path_lp``) with:

- KV rows: the part of each node's pool this gateway may fill, what its record says is left plus what this
  gateway's own sessions hold there (other gateways' sessions are theirs to plan); a node with none is left out;
- no compute rows: a record says one session's speed, not what a full batch carries.

Then, as ``planned`` says: below the optimum (``DEMAND_MARGIN`` x the measured demand under what the LP carries)
the fastest plan for that demand, on which a session with no planned room goes by ``plan_route``; else the
optimum's plan, on which it waits for room.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gateway.swarm.route_plan.chains import Chain, Graph, Spans
from gateway.swarm.route_plan.path_lp import fastest_plan, path_bound
from gateway.swarm.route_plan.planned import DEMAND_MARGIN, PlannedChain
from gateway.swarm.routing import UNKNOWN_RTT, Hop
from gateway.swarm.view import SwarmView
from shared.server_records import ServerRecord

GATEWAY = 0  # the one gateway of a view's graph


@dataclass(frozen=True)
class RoutePlan:
    chains: tuple[PlannedChain, ...]  # the chains to draw from (``planned.pick``), each with its sessions at once
    below_optimum: bool  # a demand plan: a session that finds no planned room goes by ``plan_route``
    carried: float  # tokens/s the LP's optimum carries for this gateway (its own view)


def plan_of(
    view: SwarmView,
    rtts: Mapping[str, float],
    held: Mapping[str, int],
    held_length: float,
    demand: float | None,
    work: float,
    excluded: Collection[str] = (),
    previous: Sequence[PlannedChain] = (),
    seconds: float = 5.0,
) -> RoutePlan | None:
    """The plan for sessions holding ``held_length`` tokens on average (> 0); ``held``: KV tokens this gateway's
    sessions hold per node; ``demand``: its users' tokens/s (None: not measured yet, plan for the optimum);
    ``work``: the gateway's own seconds per token; ``excluded``: nodes never routed (``verify``); ``previous``: the
    last plan's chains, a warm start. None where the LP's pricing gave up or no chain covers every block."""
    servers = sorted(
        (
            s
            for s in view.online()
            if s.peer_id not in excluded and s.throughput > 0 and _pool(s, held) > 0 and s.end <= view.num_blocks
        ),
        key=lambda s: s.peer_id,
    )
    if not servers:
        return None
    graph = _graph(servers, rtts, view.num_blocks, work)
    pool = np.array([_pool(s, held) for s in servers], dtype=float)
    capacity = np.full(len(servers), np.inf)  # no compute rows (the module's docstring)
    row = {s.peer_id: i for i, s in enumerate(servers)}
    start = tuple(
        Chain(GATEWAY, tuple((row[hop.peer_id], hop.start) for hop in c.hops))
        for c in previous
        if all(hop.peer_id in row for hop in c.hops)
    )
    found = path_bound(graph, capacity, pool, held_length, seconds, start=start)
    if found is None or found.reached <= 0:
        return None
    below = demand is not None and DEMAND_MARGIN * demand < found.reached
    if below and demand is not None:
        wanted = np.array([DEMAND_MARGIN * demand])
        chains, rates = fastest_plan(graph, capacity, pool, held_length, found.known, wanted)
    else:
        chains, rates = found.used, found.rates
    planned = tuple(
        PlannedChain(GATEWAY, tuple(Hop(servers[n].peer_id, e, servers[n].end) for n, e in c.hops), y * graph.round(c))
        for c, y in zip(chains, rates, strict=True)
    )
    return RoutePlan(planned, below, found.reached)


def _pool(server: ServerRecord, held: Mapping[str, int]) -> int:
    return min(server.cache_tokens_total, server.cache_tokens_left + held.get(server.peer_id, 0))


def _graph(servers: list[ServerRecord], rtts: Mapping[str, float], blocks: int, work: float) -> Graph:
    peers = [s.peer_id for s in servers]
    own = np.array([rtts.get(p, UNKNOWN_RTT) for p in peers]) / 2  # one way, gateway to node
    links = np.tile(own, (len(servers), 1))  # [from, to]: what the sender announced, else the gateway's own
    row = {p: i for i, p in enumerate(peers)}
    for i, server in enumerate(servers):
        for peer, rtt in server.next_rtts.items():
            if peer in row:
                links[i, row[peer]] = rtt / 2
    spans = Spans(
        np.array([s.start for s in servers], dtype=np.int64),
        np.array([s.end for s in servers], dtype=np.int64),
        np.zeros(len(servers)),
        np.array([s.block_time for s in servers]),
    )
    return Graph.of(spans, links, own[None, :], blocks, work)
