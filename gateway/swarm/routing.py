"""Route choice as pure functions over plain data: which nodes carry a session, block range by block range.

Two modes:

* ``min_latency``: the cheapest path over block boundaries, where using server ``s`` from block ``b`` to the end of
  its span costs its round-trip time, the compute time of those blocks (from its announced throughput), and a large
  penalty when it is short of cache room. A busy node charges a hop over part of its span more than those blocks:
  it runs a sub-range as a forward of its own, batched with none of its other sessions (``decode_batcher``), so a
  hop of k of its n blocks costs ``(k + (n - k) x occupancy) x block_time`` (``ServerRecord.occupancy``: the share
  of its pool in use). Idle, k blocks cost k blocks; full, the whole step (``bench/README.md``, stop 43). A route
  switches nodes only at the end of a node's span. When the chain pushes (``RouteRequest.push``), a token travels
  gateway → first → … → last → gateway: a hop costs half the RTT of the link into it (from the gateway for the
  first; for a later one, the RTT its predecessor measured and announced in ``next_rtts``, else the gateway's own),
  and the last hop half its RTT back to the gateway.
* ``max_throughput``: spread sessions: at each boundary take the server with the most per-block throughput left
  after its announced queue and the sessions this gateway already runs on it.

A node's room is the smaller of what its record says and what a refusal since taught (``RouteRequest.room_left``).
A session of a LoRA adapter goes only through nodes that announce it. Banned servers are skipped, except for a
block whose every server is banned: then bans are ignored for that block. Excluded servers (in probation, failed
or distrusted: ``gateway.swarm.verify``) are never used; a node's ``penalties`` (less reputation) add to its cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import repeat

import numpy as np

from gateway.swarm import route_search
from gateway.swarm.view import SwarmView
from shared.server_records import ServerRecord

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
    # Tokens of room a node has at most, below what its record says: it refused a session of more since that record
    # (``gateway.swarm.room_refusals``). Read like the record's own ``cache_tokens_left``: the cache-short penalty.
    room_left: Mapping[str, int] = field(default_factory=dict)


def plan_route(view: SwarmView, request: RouteRequest, mode: RoutingMode) -> list[Hop]:
    """Hops covering blocks [start, end); raises ``MissingBlocks`` naming every block nobody serves."""
    end = view.num_blocks if request.end is None else request.end
    table = _table(view, request.adapter)
    if mode is RoutingMode.MIN_LATENCY:  # bans priced in the search (``route_search``'s docstring)
        enterable = route_search.enterable(table, frozenset(), request.start, end, request.excluded)
        legs = _legs(table, enterable, request, end)
        hops = route_search.cheapest(legs, request.start, end, request.push)
        return [Hop(table.peers[i], start, stop) for i, start, stop in hops]
    enterable = route_search.enterable(table, request.banned, request.start, end, request.excluded)
    return _max_throughput(list(table.servers), enterable, request, end)


def _table(view: SwarmView, adapter: str | None) -> route_search.ServerTable:
    """The view's servers (of ``adapter``) as arrays, kept on the view: every route planned on it shares them."""
    key = ("route_table", adapter)
    table = view.memo.get(key)
    if not isinstance(table, route_search.ServerTable):
        table = view.memo[key] = route_search.table_of(view.serving(0, view.num_blocks, adapter))
    return table


def hop_cost(
    server: ServerRecord, blocks: int, request: RouteRequest, before: ServerRecord | None = None, last: bool = False
) -> float:
    """Seconds a token spends on ``server``'s ``blocks``: compute, and its links (see the module docstring)."""
    own_rtt = request.rtts.get(server.peer_id, UNKNOWN_RTT)
    block_time = server.block_time if server.throughput > 0 else UNKNOWN_BLOCK_TIME
    compute = (blocks + (server.end - server.start - blocks) * server.occupancy) * block_time
    penalty = CACHE_SHORT_PENALTY if cache_room(server, request) < request.max_length else 0.0
    penalty += request.penalties.get(server.peer_id, 0.0)
    if not request.push:
        return own_rtt + compute + penalty
    link_in = own_rtt if before is None else before.next_rtts.get(server.peer_id, own_rtt)
    return link_in / 2 + (own_rtt / 2 if last else 0.0) + compute + penalty


def cache_room(server: ServerRecord, request: RouteRequest) -> int:
    """Tokens of cache room ``server`` has for all routing knows: its record's, or less after a refusal."""
    return min(server.cache_tokens_left, request.room_left.get(server.peer_id, server.cache_tokens_left))


def short_of_room(view: SwarmView, request: RouteRequest, hops: list[Hop]) -> frozenset[str]:
    """The hops' nodes routing read as short of room for the session (it paid ``CACHE_SHORT_PENALTY`` for them:
    nothing with room served their blocks). Asked without a wait, such a node refuses and the next route finds
    another like it: a failover asks it to hold the open until it has room instead (``failover``)."""
    return frozenset(
        hop.peer_id
        for hop in hops
        if hop.peer_id in view.servers and cache_room(view.servers[hop.peer_id], request) < request.max_length
    )


def _cache_left(table: route_search.ServerTable, request: RouteRequest) -> route_search.Ints:
    """``cache_room`` for the table's servers, by row (the table's own array when no refusal applies)."""
    if not request.room_left:
        return table.cache_left
    refused = [(row, request.room_left[p]) for row, p in enumerate(table.peers) if p in request.room_left]
    if not refused:
        return table.cache_left
    left = table.cache_left.copy()
    rows, rooms = zip(*refused, strict=True)
    left[list(rows)] = np.minimum(left[list(rows)], rooms)
    return left


def _legs(
    table: route_search.ServerTable, enterable: dict[int, route_search.Ints], request: RouteRequest, end: int
) -> route_search.Legs:
    """``hop_cost``'s terms per server, split into what depends on where a route enters it and what does not."""
    own = np.fromiter(map(request.rtts.get, table.peers, repeat(UNKNOWN_RTT)), np.float64, len(table.peers))
    reach = np.minimum(table.ends, end)
    measured = table.throughput > 0
    rate = np.where(measured, table.throughput * (table.ends - table.starts), 1.0)
    block_time = np.where(measured, 1.0 / rate, UNKNOWN_BLOCK_TIME)  # ServerRecord.block_time, or the default
    busy = table.occupancy
    span_time = block_time * (table.ends - table.starts)
    block_time = block_time * (1.0 - busy)  # a hop of k blocks: (k + (span - k) x busy) x block_time
    fixed = busy * span_time + np.where(_cache_left(table, request) < request.max_length, CACHE_SHORT_PENALTY, 0.0)
    if request.penalties:
        fixed = fixed + np.fromiter((request.penalties.get(p, 0.0) for p in table.peers), np.float64, len(table.peers))
    if request.push:
        fixed = fixed + np.where(reach == end, own / 2, 0.0)
    own_link = own / 2 if request.push else own
    entry = (request.start, end, frozenset[str](), request.excluded)
    return route_search.Legs(table, reach, block_time, fixed, own_link, enterable, entry, request.banned)


def _max_throughput(
    servers: list[ServerRecord], enterable: dict[int, route_search.Ints], request: RouteRequest, end: int
) -> list[Hop]:
    def spare_rate(server: ServerRecord) -> tuple[bool, float, str]:
        has_room = cache_room(server, request) >= request.max_length
        rate = (server.throughput or 1.0) * (server.end - server.start)  # block-tokens per second
        busy = 1 + server.queue_depth + request.load.get(server.peer_id, 0)
        trusted = 1.0 - request.penalties.get(server.peer_id, 0.0)  # reputation orders equally spare nodes
        return has_room, rate * trusted / busy, server.peer_id

    hops = []
    block = request.start
    while block < end:
        server = max((servers[i] for i in enterable[block]), key=spare_rate)
        reach = min(server.end, end)
        hops.append(Hop(server.peer_id, block, reach))
        block = reach
    return hops
