"""The route search behind ``routing.plan_route``: a shortest path by scipy's Dijkstra (C), fast enough for a swarm of
a thousand nodes.

A route goes forward only (a server entered at boundary ``b`` takes it to ``min(end, server.end) > b``). Its state
after a hop is the server that made it, as the price of the next leg depends on it when pushing: a leg's link is the
half round trip its predecessor measured and announced (``next_rtts``), else its own (from the gateway). The graph,
one vertex per server (the state after a hop on it) and one per boundary ``b`` of [start, end) (``B_b``; ``B_start``
is the source):

* every server whose leg ends at ``b`` -> ``B_b``, weight 0: a state that reached ``b``;
* ``B_b`` -> every server enterable at ``b`` that no server ending at ``b`` measured: the leg at its own link, whoever
  the state before (so the cheapest one is taken);
* when pushing, every server ending at ``b`` -> each server enterable at ``b`` that one of them measured: by its
  measured link, or the leg's own where it measured none. A state pays the link it measured, never the gateway's.

A leg entered at ``b`` weighs ``fixed + (reach - b) x block_time + link`` (``routing.hop_cost``); a leg into a banned
server weighs infinity, unless every server of its block left is banned (a ban gives way: ``enterable``), which
is the same route as a graph without those legs. What never changes between the routes planned on one view (which
servers measured which links, ``MeasuredLinks``; the edges of a range less its excluded servers, ``_Graph``) is
built once and kept on its table; per route, the weights are a few array operations over the edges. (The graph was
kept per set of banned servers too: a gateway that reopens a chain past full nodes one at a time bans a new set
each time, and rebuilt it for almost every route.) Dijkstra gives every vertex's cost; the hops are then read
backwards with fixed ties, so the route is the same whatever order the heap pops equal costs in: the last hop is the
lowest peer among the cheapest reaching ``end``; a hop's entry is the earliest boundary from which an edge gives its
cost, then from the cheapest state, then the lowest peer. (The search before this, a dynamic programme over the
boundaries in Python, cost about 4-6 ms per route at 1,000 nodes with measured links: bench/README.md.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

from shared.errors import MissingBlocks
from shared.server_records import ServerRecord

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
EntryKey = tuple[int, int, frozenset[str], frozenset[str]]  # a route's block range, its banned and excluded servers
NO_SERVER = -1  # the state before the first hop


@dataclass(frozen=True)
class MeasuredLinks:
    """The legs a route prices by what servers measured (``next_rtts``), as edges by row, built with the table: from
    every server ending at a boundary to each server of the next block that one of them measured."""

    boundary: Ints  # where the leg is entered: the end of the state's span
    state: Ints  # the server before
    leg: Ints  # the server entered
    half: Floats  # the state's measured RTT / 2 to the leg; NaN where it measured none (then the leg's own link)


@dataclass(frozen=True)
class Legs:
    """The servers a route may use, in peer order, with the parts of ``routing.hop_cost`` that do not depend on
    where the route enters them: a leg entered at ``b`` costs ``fixed + (reach - b) * block_time + link``."""

    table: ServerTable
    reach: Ints  # the boundary each takes the route to
    block_time: Floats
    fixed: Floats  # the cache penalty, and when pushing from the last hop the half RTT back to the gateway
    own_link: Floats  # the link into it when its predecessor measured none
    enterable: dict[int, Ints]  # per boundary: its servers less the excluded, ascending (``enterable``, no bans)
    entry: EntryKey  # what ``enterable`` was made for: the route's graph is kept on the table by it
    banned: frozenset[str] = frozenset()  # priced out of the route (the module docstring)


@dataclass(frozen=True)
class ServerTable:
    """Servers as arrays, in peer order: built once per view (and adapter), shared by every route planned on it."""

    servers: Sequence[ServerRecord]
    starts: Ints
    ends: Ints
    throughput: Floats
    cache_left: Ints
    occupancy: Floats  # ServerRecord.occupancy
    peers: list[str]
    links: MeasuredLinks
    rows: dict[str, int]  # peer id -> row
    covers: dict[tuple[int, int], dict[int, Ints]] = field(default_factory=dict)  # ``_cover``'s, by block range
    enterable: dict[EntryKey, dict[int, Ints]] = field(default_factory=dict)  # ``enterable``'s
    graphs: dict[tuple[EntryKey, bool], _Graph] = field(default_factory=dict)  # ``_graph``'s, and whether pushing


def table_of(servers: Sequence[ServerRecord]) -> ServerTable:
    ordered = sorted(servers, key=lambda s: s.peer_id)
    index = {s.peer_id: i for i, s in enumerate(ordered)}
    return ServerTable(
        ordered,
        np.array([s.start for s in ordered], dtype=np.int64),
        np.array([s.end for s in ordered], dtype=np.int64),
        np.array([s.throughput for s in ordered], dtype=np.float64),
        np.array([s.cache_tokens_left for s in ordered], dtype=np.int64),
        np.array([s.occupancy for s in ordered], dtype=np.float64),
        [s.peer_id for s in ordered],
        measured_links(ordered, index),
        index,
    )


def measured_links(ordered: Sequence[ServerRecord], index: dict[str, int]) -> MeasuredLinks:
    starts, ends = [s.start for s in ordered], [s.end for s in ordered]
    measured: dict[int, dict[int, dict[int, float]]] = {}  # boundary -> leg -> {state: its RTT to the leg}
    for row, server in enumerate(ordered):
        for peer, rtt in server.next_rtts.items():
            to = index.get(peer)
            # Only a server of its end block can follow a server in a route: links to others are never priced.
            if to is not None and starts[to] <= ends[row] < ends[to]:
                measured.setdefault(ends[row], {}).setdefault(to, {})[row] = rtt
    ending: dict[int, list[int]] = {}
    for row, end in enumerate(ends):
        ending.setdefault(end, []).append(row)
    edges = [
        (boundary, state, to, by[state] / 2 if state in by else math.nan)
        for boundary, legs in measured.items()
        for to, by in legs.items()
        for state in ending[boundary]  # every state there: a leg one of them measured is entered from each
    ]
    columns = list(zip(*edges, strict=True)) if edges else [(), (), (), ()]
    rows = [np.array(column, dtype=np.int64) for column in columns[:3]]
    return MeasuredLinks(rows[0], rows[1], rows[2], np.array(columns[3], dtype=np.float64))


def enterable(
    table: ServerTable, banned: frozenset[str], start: int, end: int, excluded: frozenset[str] = frozenset()
) -> dict[int, Ints]:
    """Per block of [start, end), who a route may enter there: its servers less the excluded (never used: a block
    left with none is missing) and less the banned ones, unless every one left is banned. Kept on the table (every
    route with the same bans shares it); the table stays the view's whole one (servers outside the range are never
    enterable): rebuilding it per route would cost more than the route (``MeasuredLinks``)."""
    cover = _cover(table, start, end)
    if not banned and not excluded:
        return cover
    key = (start, end, banned, excluded)
    if key in table.enterable:
        return table.enterable[key]
    allowed = np.array([p not in banned for p in table.peers], dtype=bool)
    trusted = np.array([p not in excluded for p in table.peers], dtype=bool)
    chosen, missing = {}, []
    for block, servers in cover.items():
        left = servers[trusted[servers]]
        if not len(left):
            missing.append(block)
        kept = left[allowed[left]]
        chosen[block] = kept if len(kept) else left
    if missing:
        raise MissingBlocks(missing)
    table.enterable[key] = chosen
    return chosen


def _cover(table: ServerTable, start: int, end: int) -> dict[int, Ints]:
    """Per block of [start, end), its servers (kept on the table: every route over the range shares them)."""
    if (start, end) in table.covers:
        return table.covers[(start, end)]
    if not table.servers:
        raise MissingBlocks(list(range(start, end)))
    blocks = np.arange(start, end)[:, None]
    cover = (table.starts[None, :] <= blocks) & (table.ends[None, :] > blocks)  # [blocks, servers]
    missing = [int(b) for b in np.flatnonzero(~cover.any(axis=1)) + start]
    if missing:
        raise MissingBlocks(missing)
    table.covers[(start, end)] = {start + row: np.flatnonzero(mask) for row, mask in enumerate(cover)}
    return table.covers[(start, end)]


@dataclass(frozen=True)
class _Graph:
    """A route's graph (the module docstring) without its weights, edges in CSR order (by the vertex they leave):
    servers are vertices 0..n-1, boundary ``b`` is vertex ``n + b - start``. The same for every route over a range
    with the same servers excluded, so kept on the table (``_graph_of``)."""

    start: int
    servers: int
    indptr: Ints
    tails: Ints  # per edge: the vertex it leaves
    heads: Ints  # per edge: the vertex it enters
    legs: Ints  # the edges that enter a server: a leg (the others enter a boundary's vertex and weigh 0)
    left: Ints  # per leg: the blocks it runs (the server's reach less the boundary it is entered at)
    half: Floats  # per leg: the measured half RTT into it, NaN where the leg's own link is priced
    by_head: Ints  # the edges by the vertex they enter: server s's at ``by_head[into[s]:into[s + 1]]``
    into: Ints
    cover_block: Ints  # every (block, server) a route may enter, as two arrays: whether a block has one not banned
    cover_server: Ints

    def weights(self, legs: Legs) -> Floats:
        """Per edge, ``routing.hop_cost`` of its leg: ``fixed + blocks x block_time + link``; 0 into a boundary."""
        entered = self.heads[self.legs]
        link = np.where(np.isnan(self.half), legs.own_link[entered], self.half)
        weights = np.zeros(len(self.heads))
        weights[self.legs] = legs.fixed[entered] + self.left * legs.block_time[entered] + link
        return weights


def cheapest(legs: Legs, start: int, end: int, push: bool) -> list[tuple[int, int, int]]:
    """(server index, from, to) hops of the cheapest route over [start, end)."""
    graph = _graph_of(legs, start, end, push)
    weights = graph.weights(legs)
    if legs.banned:
        weights[_banned_legs(legs, graph)] = np.inf
    size = graph.servers + end - start
    matrix = csr_matrix((weights, graph.heads, graph.indptr), shape=(size, size))
    cost = dijkstra(matrix, directed=True, indices=graph.servers)
    return _hops(legs, graph, weights, cost, end)


def _banned_legs(legs: Legs, graph: _Graph) -> Ints:
    """The edges into a banned server at a block where some server is not banned (``enterable``'s rule)."""
    banned = np.zeros(graph.servers, dtype=bool)
    banned[[legs.table.rows[p] for p in legs.banned if p in legs.table.rows]] = True
    free = np.bincount(graph.cover_block - graph.start, ~banned[graph.cover_server], minlength=len(legs.enterable))
    heads = graph.heads[graph.legs]
    at = legs.reach[heads] - graph.left
    return graph.legs[banned[heads] & (free[at - graph.start] > 0)]


def _graph_of(legs: Legs, start: int, end: int, push: bool) -> _Graph:
    """The route's graph, kept on the table for every route with the same range and exclusions."""
    key = (legs.entry, push)
    if key not in legs.table.graphs:
        legs.table.graphs[key] = _graph(legs, start, end, push)
    return legs.table.graphs[key]


def _graph(legs: Legs, start: int, end: int, push: bool) -> _Graph:
    n = len(legs.reach)
    per_block = [legs.enterable[block] for block in range(start, end)]
    entered = np.concatenate(per_block)
    at = np.repeat(np.arange(start, end), [len(servers) for servers in per_block])
    cover = (at, entered)
    edges = [_measured_edges(legs.table.links, n, start, end, at * n + entered)] if push else []
    if edges:  # a leg some state measured is entered from the states, not from the boundary's vertex
        plain = ~np.isin(at * n + entered, edges[0].at * n + edges[0].head)
        entered, at = entered[plain], at[plain]
    edges.append(_Edges(n + at - start, entered, at, np.full(len(at), np.nan)))
    ending = np.flatnonzero((legs.reach > start) & (legs.reach < end))
    edges.append(_Edges(ending, n + legs.reach[ending] - start, np.full(len(ending), -1), np.full(len(ending), np.nan)))
    tails, heads, ats, halves = (np.concatenate([getattr(e, f) for e in edges]) for f in ("tail", "head", "at", "half"))
    order = np.argsort(tails, kind="stable")
    tails, heads, ats, halves = tails[order], heads[order], ats[order], halves[order]
    leg_edges = np.flatnonzero(heads < n)
    by_head = np.argsort(heads, kind="stable")
    return _Graph(
        start, n, np.searchsorted(tails, np.arange(n + end - start + 1)), tails, heads, leg_edges,
        legs.reach[heads[leg_edges]] - ats[leg_edges], halves[leg_edges], by_head,
        np.searchsorted(heads[by_head], np.arange(n + 1)), *cover,
    )  # fmt: skip


@dataclass(frozen=True)
class _Edges:
    tail: Ints  # the vertex left
    head: Ints  # the vertex entered
    at: Ints  # the boundary a leg is entered at (-1 for an edge into a boundary's vertex)
    half: Floats  # the measured half RTT, NaN where the leg's own link is priced


def _measured_edges(links: MeasuredLinks, n: int, start: int, end: int, enterable: Ints) -> _Edges:
    """The measured links' edges a route over [start, end) may take: after its start, into enterable servers
    (``enterable``: boundary x n + server, ascending)."""
    keys = links.boundary * n + links.leg
    slot = np.minimum(np.searchsorted(enterable, keys), len(enterable) - 1)
    kept = (links.boundary > start) & (links.boundary < end) & (enterable[slot] == keys)
    return _Edges(links.state[kept], links.leg[kept], links.boundary[kept], links.half[kept])


def _hops(legs: Legs, graph: _Graph, weights: Floats, cost: Floats, end: int) -> list[tuple[int, int, int]]:
    """The route read backwards from the costs, ties broken as the module docstring says."""
    server = int(np.argmin(np.where(legs.reach == end, cost[: graph.servers], np.inf)))
    hops = []
    while server != NO_SERVER:
        edges = graph.by_head[graph.into[server] : graph.into[server + 1]]
        reached = edges[cost[graph.tails[edges]] + weights[edges] == cost[server]]
        boundary, _, state = min(_entry(legs, graph, cost, int(graph.tails[e])) for e in reached)
        hops.append((server, boundary, int(legs.reach[server])))
        server = state
    return hops[::-1]


def _entry(legs: Legs, graph: _Graph, cost: Floats, vertex: int) -> tuple[int, float, int]:
    """(boundary, cost before, state before) of an edge into a hop from ``vertex``: a server, or a boundary's vertex
    (then the state is the lowest peer among the cheapest ending there; none from the source)."""
    if vertex < graph.servers:
        return int(legs.reach[vertex]), float(cost[vertex]), vertex
    boundary = vertex - graph.servers + graph.start
    if boundary == graph.start:
        return boundary, 0.0, NO_SERVER
    states = np.flatnonzero(legs.reach == boundary)
    return boundary, float(cost[vertex]), int(states[cost[states] == cost[vertex]][0])
