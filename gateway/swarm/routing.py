"""Route choice as pure functions over plain data: which nodes carry a session, block range by block range.

Two modes:

* ``min_latency``: the cheapest path over block boundaries, where using server ``s`` from block ``b`` to the end of
  its span costs its round-trip time, the compute time of those blocks (from its announced throughput), and a large
  penalty when it is short of cache room. A route switches nodes only at the end of a node's span. When the chain
  pushes (``RouteRequest.push``), a token travels gateway → first → … → last → gateway: a hop costs half the RTT of
  the link into it (from the gateway for the first; for a later one, the RTT its predecessor measured and announced
  in ``next_rtts``, else the gateway's own), and the last hop half its RTT back to the gateway.
* ``max_throughput``: spread sessions: at each boundary take the server with the most per-block throughput left
  after its announced queue and the sessions this gateway already runs on it.

A session of a LoRA adapter goes only through nodes that announce it. Banned servers are skipped, except for a
block whose every server is banned: then bans are ignored for that block. Excluded servers (in probation, failed
or distrusted: ``gateway.swarm.verify``) are never used; a node's ``penalties`` (less reputation) add to its cost.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.swarm.view import SwarmView
from shared.dht_records import ServerRecord
from shared.errors import MissingBlocks

# Seconds-equivalent added to a node without room for the session: chosen only when nothing else serves its blocks.
CACHE_SHORT_PENALTY = 60.0
# Round-trip time assumed for a node not measured yet (pessimistic, so measured nearby nodes win).
UNKNOWN_RTT = 0.1
# Seconds per block assumed for a node that announced no throughput yet.
UNKNOWN_BLOCK_TIME = 0.1


class RoutingMode(StrEnum):
    MIN_LATENCY = "min_latency"
    MAX_THROUGHPUT = "max_throughput"


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start: int
    end: int


@dataclass(frozen=True)
class RouteRequest:
    """Everything a route depends on besides the swarm itself."""

    max_length: int  # tokens the session will hold on each node
    start: int = 0
    end: int | None = None
    rtts: Mapping[str, float] = field(default_factory=dict)
    banned: frozenset[str] = frozenset()
    load: Mapping[str, int] = field(default_factory=dict)  # this gateway's open sessions per node
    push: bool = False  # hidden states go node to node: a later hop's link is from its predecessor
    adapter: str | None = None  # a LoRA adapter every hop must serve (None: the base model, any node)
    excluded: frozenset[str] = frozenset()  # never routed: not (or no longer) trusted to compute right
    penalties: Mapping[str, float] = field(default_factory=dict)  # seconds-equivalent per hop, by reputation


def plan_route(view: SwarmView, request: RouteRequest, mode: RoutingMode) -> list[Hop]:
    """Hops covering blocks [start, end); raises ``MissingBlocks`` naming every block nobody serves."""
    end = view.num_blocks if request.end is None else request.end
    candidates = _candidates(view, request, end)
    if mode is RoutingMode.MIN_LATENCY:
        return _min_latency(candidates, request, end)
    return _max_throughput(candidates, request, end)


def _candidates(view: SwarmView, request: RouteRequest, end: int) -> dict[int, list[ServerRecord]]:
    """Per block, the servers a route may use there."""
    candidates: dict[int, list[ServerRecord]] = {}
    missing = []
    for block in range(request.start, end):
        servers = [s for s in view.servers_for(block, request.adapter) if s.peer_id not in request.excluded]
        if not servers:
            missing.append(block)
        allowed = [s for s in servers if s.peer_id not in request.banned]
        candidates[block] = allowed or servers
    if missing:
        raise MissingBlocks(missing)
    return candidates


def hop_cost(
    server: ServerRecord, blocks: int, request: RouteRequest, before: ServerRecord | None = None, last: bool = False
) -> float:
    """Seconds a token spends on ``server``'s ``blocks``: compute, and its links (see the module docstring)."""
    own_rtt = request.rtts.get(server.peer_id, UNKNOWN_RTT)
    block_time = server.block_time if server.throughput > 0 else UNKNOWN_BLOCK_TIME
    penalty = CACHE_SHORT_PENALTY if server.cache_tokens_left < request.max_length else 0.0
    penalty += request.penalties.get(server.peer_id, 0.0)
    if not request.push:
        return own_rtt + blocks * block_time + penalty
    link_in = own_rtt if before is None else before.next_rtts.get(server.peer_id, own_rtt)
    return link_in / 2 + (own_rtt / 2 if last else 0.0) + blocks * block_time + penalty


_State = tuple[int, str]  # (block boundary, the server that reached it: "" at the start, or when links do not matter)


def _min_latency(candidates: dict[int, list[ServerRecord]], request: RouteRequest, end: int) -> list[Hop]:
    # Dijkstra over block boundaries: an edge b -> min(s.end, end) for each server s usable at block b. With push the
    # cost of an edge depends on the server before it, so a state is (boundary, that server).
    servers = {s.peer_id: s for block in candidates.values() for s in block}
    start: _State = (request.start, "")
    best: dict[_State, float] = {start: 0.0}
    came_from: dict[_State, tuple[_State, Hop]] = {}
    queue: list[tuple[float, _State]] = [(0.0, start)]
    final = start
    while queue:
        cost, state = heapq.heappop(queue)
        block, before = state
        if block == end:
            final = state
            break
        if cost > best.get(state, float("inf")):
            continue
        for server in sorted(candidates[block], key=lambda s: s.peer_id):
            reach = min(server.end, end)
            total = cost + hop_cost(server, reach - block, request, servers.get(before), reach == end)
            reached = (reach, server.peer_id if request.push else "")
            if total < best.get(reached, float("inf")):
                best[reached] = total
                came_from[reached] = (state, Hop(server.peer_id, block, reach))
                heapq.heappush(queue, (total, reached))
    hops = []
    while final != start:
        final, hop = came_from[final]
        hops.append(hop)
    return hops[::-1]


def _max_throughput(candidates: dict[int, list[ServerRecord]], request: RouteRequest, end: int) -> list[Hop]:
    def spare_rate(server: ServerRecord) -> tuple[bool, float, str]:
        has_room = server.cache_tokens_left >= request.max_length
        rate = (server.throughput or 1.0) * (server.end - server.start)  # block-tokens per second
        busy = 1 + server.queue_depth + request.load.get(server.peer_id, 0)
        trusted = 1.0 - request.penalties.get(server.peer_id, 0.0)  # reputation orders equally spare nodes
        return has_room, rate * trusted / busy, server.peer_id

    hops = []
    block = request.start
    while block < end:
        server = max(candidates[block], key=spare_rate)
        reach = min(server.end, end)
        hops.append(Hop(server.peer_id, block, reach))
        block = reach
    return hops
