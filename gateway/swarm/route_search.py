"""The route search behind ``routing.plan_route``, over arrays: fast enough for a swarm of a thousand nodes.

A route goes forward only (a server entered at boundary ``b`` takes it to ``min(end, server.end) > b``), so the
boundaries form a DAG and the cheapest route is a dynamic programme over them in increasing order — no heap. The
state after a hop is the server that made it (its cost to the next one depends on it when pushing). Each boundary
relaxes its servers once, as arrays, from the cheapest state that reached it; a state changes the price of a leg
only for the few nodes it measured (``next_rtts``), and those legs are priced apart. The simple search this
replaced (a Dijkstra relaxing every server from every state, in Python) took 75 ms per route at 1,000 nodes
without push and 475 ms with it (the simulator's finding, ``bench/results/sim.md``).

Measured legs are priced with Python floats and C-level builtins, not NumPy: a boundary has about 8 states with 4
links each (swarm_node probes 4 servers of its end block), and NumPy's cost per call (about 1 µs here, 15 calls to
price them) is more than the work. What is per link is found once per table (``LinksAt``: per boundary and leg, each
state's half RTT), so a leg's cheapest offer is one ``min`` over ``map(add, costs, halves)``; a leg's price terms
are read from lists made once per route (``Legs.scalars``). The same goes for a boundary's states (``_states``).
The arithmetic (the order of each sum) and the ties are exactly the old search's: the same hops, float for float.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

from shared.errors import MissingBlocks
from shared.server_records import ServerRecord

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
NO_SERVER = -1  # the state before the first hop


@dataclass(frozen=True)
class MeasuredLinks:
    """The round trips servers measured to others and announced (``next_rtts``), by row: built with the table."""

    rtts: list[dict[int, float]]  # per server: the RTT to each server it measured
    offers: list[list[tuple[int, float]]]  # per server: (row, RTT / 2) to those serving its end block, by row
    offered: list[Ints]  # per server: the rows of its offers
    at: dict[int, LinksAt]  # per boundary: the links of the servers whose span ends there


@dataclass(frozen=True)
class LinksAt:
    """The measured links that leave one boundary: from the servers whose span ends there (``rows``) to the servers
    of the next block they measured (``halves``: per such leg, each row's half RTT to it, inf where it measured
    none), so that a leg's cheapest offer is one C-level ``min`` over the rows rather than a Python loop."""

    rows: Ints  # the servers ending here that measured a link, by row
    row_list: list[int]
    halves: dict[int, list[float]]
    measurers: dict[int, frozenset[int]]  # per leg: the servers that measured a link to it
    everyone: bool  # whether every server ending here measured every leg (then none offers a leg its plain price)


def measured_links(ordered: Sequence[ServerRecord], index: dict[str, int]) -> MeasuredLinks:
    rtts = [{index[p]: rtt for p, rtt in s.next_rtts.items() if p in index} if s.next_rtts else {} for s in ordered]
    starts, ends = [s.start for s in ordered], [s.end for s in ordered]
    # Only a server of its end block can follow a server in a route: links to others are never priced.
    offers = [
        [(row, rtt / 2) for row, rtt in sorted(out.items()) if starts[row] <= end < ends[row]] if out else []
        for end, out in zip(ends, rtts, strict=True)
    ]
    measuring: dict[int, list[int]] = {}
    for row, out in enumerate(offers):
        if out:
            measuring.setdefault(ends[row], []).append(row)
    ending = Counter(ends)
    none = np.zeros(0, dtype=np.int64)
    offered = [np.array([row for row, _ in out], dtype=np.int64) if out else none for out in offers]
    return MeasuredLinks(
        rtts, offers, offered, {end: _links_at(rows, offers, ending[end]) for end, rows in measuring.items()}
    )


def _links_at(rows: list[int], offers: list[list[tuple[int, float]]], ending: int) -> LinksAt:
    halves: dict[int, list[float]] = {}
    measurers: dict[int, set[int]] = {}
    for i, row in enumerate(rows):
        for leg, half_rtt in offers[row]:
            halves.setdefault(leg, [math.inf] * len(rows))[i] = half_rtt
            measurers.setdefault(leg, set()).add(row)
    everyone = all(len(m) == ending for m in measurers.values())
    frozen = {leg: frozenset(by) for leg, by in measurers.items()}
    return LinksAt(np.array(rows, dtype=np.int64), rows, dict(sorted(halves.items())), frozen, everyone)


@dataclass(frozen=True)
class Legs:
    """The servers a route may use, in peer order, with the parts of ``routing.hop_cost`` that do not depend on
    where the route enters them: a leg entered at ``b`` costs ``fixed + (reach - b) * block_time + link``."""

    links: MeasuredLinks  # ServerTable.links
    reach: Ints  # the boundary each takes the route to
    block_time: Floats
    fixed: Floats  # the cache penalty, and when pushing from the last hop the half RTT back to the gateway
    own_link: Floats  # the link into it when its predecessor measured none
    enterable: dict[int, Ints]  # per boundary: the servers a route may enter there
    banned: bool = False  # whether some server is banned or excluded: then a measured leg is checked against
    # ``enterable`` (a measured link may lead to a server a route must not enter)

    @cached_property
    def scalars(self) -> LegScalars:
        return LegScalars(self.fixed.tolist(), self.reach.tolist(), self.block_time.tolist(), self.own_link.tolist())


@dataclass(frozen=True)
class LegScalars:
    """``Legs``' arrays as lists of Python floats: what pricing a measured leg reads, a few at a time."""

    fixed: list[float]
    reach: list[int]
    block_time: list[float]
    own_link: list[float]


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
    covers: dict[tuple[int, int], dict[int, Ints]] = field(default_factory=dict)  # ``_cover``'s, by block range


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
    )


def usable(
    table: ServerTable, banned: frozenset[str], start: int, end: int, excluded: frozenset[str] = frozenset()
) -> dict[int, Ints]:
    """Per block of [start, end), who a route may enter there: its servers less the excluded (never used: a block
    left with none is missing) and less the banned ones, unless every one left is banned. The table stays the
    view's whole one (servers outside the range are never enterable): rebuilding it per route would cost more
    than the route (``MeasuredLinks``)."""
    cover = _cover(table, start, end)
    if not banned and not excluded:
        return cover
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


def cheapest(legs: Legs, start: int, end: int, push: bool) -> list[tuple[int, int, int]]:
    """(server index, from, to) hops of the cheapest route over [start, end)."""
    n = len(legs.reach)
    cost = np.full(n, np.inf)
    before = np.full(n, NO_SERVER, dtype=np.int64)
    entered = np.zeros(n, dtype=np.int64)
    order = np.argsort(legs.reach, kind="stable")
    bounds = np.searchsorted(legs.reach[order], np.arange(start, end + 1)).tolist()
    ending = order.tolist()  # servers by the boundary their legs end at, in peer order at each
    plain = _PlainTerms.of(legs, start, end)
    for block in range(start, end):
        if block == start:
            states, bases = [NO_SERVER], [0.0]
        else:
            here = slice(bounds[block - start], bounds[block - start + 1])
            states, bases = _states(ending[here], cost[order[here]].tolist(), push and _priced_apart(legs, block))
        if states:
            _relax(legs, plain, block, states, bases, cost, before, entered, push)
    last = int(np.argmin(np.where(legs.reach == end, cost, np.inf)))
    hops = []
    while last != NO_SERVER:
        hops.append((last, int(entered[last]), int(legs.reach[last])))
        last = int(before[last])
    return hops[::-1]


@dataclass(frozen=True)
class _PlainTerms:
    """What a leg costs besides the route's cost so far, for every (boundary, enterable leg) of a route, made in one
    pass: ``fixed`` + ``blocks`` (compute) + ``link`` (its own link) at ``bounds[b]:bounds[b + 1]``, the legs of
    boundary ``start + b`` in ``enterable``'s order. Kept apart because a leg is priced ``((cost + fixed) + blocks) +
    link`` and float addition is not associative: the same sum as ever, so the same ties."""

    start: int
    fixed: Floats
    blocks: Floats
    link: Floats
    bounds: list[int]

    def priced(self, base: float, block: int) -> Floats:
        """``routing.hop_cost`` of each leg enterable at ``block``, plus ``base`` (the cost of the state before)."""
        here = slice(self.bounds[block - self.start], self.bounds[block - self.start + 1])
        return base + self.fixed[here] + self.blocks[here] + self.link[here]

    @classmethod
    def of(cls, legs: Legs, start: int, end: int) -> _PlainTerms:
        per_block = [legs.enterable[block] for block in range(start, end)]
        sizes = [len(idx) for idx in per_block]
        idx = np.concatenate(per_block)
        at = np.repeat(np.arange(start, end), sizes)
        blocks = (legs.reach[idx] - at) * legs.block_time[idx]
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        return cls(start, legs.fixed[idx], blocks, legs.own_link[idx], bounds)


def _priced_apart(legs: Legs, block: int) -> bool:
    """Whether the states at ``block`` other than the cheapest price some leg: some measured a link, and not every
    one measured every leg (then each leg's price is its cheapest measured offer, ``_offers``, read from the table
    by row, and the states' order is never asked)."""
    leaving = legs.links.at.get(block)
    return leaving is not None and not leaving.everyone


def _states(reached: list[int], costs: list[float], apart: bool) -> tuple[list[int], list[float]]:
    """The servers whose legs end at a boundary and were reached, cheapest first, then by peer, and their costs.
    Only the cheapest prices the legs from there unless others price some apart (``apart``, ``_priced_apart``):
    then all of them, in that order. In Python: a boundary has a few servers, fewer than NumPy's cost per call pays
    for."""
    live = [(c, i) for c, i in zip(costs, reached, strict=True) if c < math.inf]
    if not live:
        return [], []
    if apart:
        live.sort()
        return [i for _, i in live], [c for c, _ in live]
    c, i = min(live)  # the first of the cheapest: the lowest peer
    return [i], [c]


def _relax(
    legs: Legs, plain: _PlainTerms, block: int, states: list[int], bases: list[float], cost: Floats, before: Ints,
    entered: Ints, push: bool,
) -> None:  # fmt: skip
    """Price every leg enterable at ``block`` from the states that reached it, cheapest first (all final: they
    entered earlier boundaries)."""
    best = states[0]
    idx = legs.enterable[block]
    priced = plain.priced(bases[0], block)
    better = priced < cost[idx]
    measured = push and best != NO_SERVER and len(legs.links.offers[best]) > 0
    if measured:  # the best state's measured legs are priced below
        better[_positions(idx, legs.links.offered[best], legs.banned)] = False
    _update(cost, before, entered, idx[better], priced[better], best, block)
    if measured or (push and len(states) > 1):  # more than one state: some priced apart (``_states``)
        _relax_measured(legs, block, states, bases, cost, before, entered)


def _positions(idx: Ints, legs: Ints, banned: bool) -> Ints:
    """Where ``legs`` (servers of the boundary) are in ``idx`` (sorted): all there unless some are banned."""
    at = np.searchsorted(idx, legs)
    if banned:
        at = at[(at < len(idx)) & (idx[np.minimum(at, len(idx) - 1)] == legs)]
    return at


def _relax_measured(
    legs: Legs, block: int, states: list[int], bases: list[float], cost: Floats, before: Ints, entered: Ints
) -> None:
    """Legs whose price some state's measured link changes: the cheapest of those measured offers and the plain one
    from the cheapest state that measured nothing to the leg."""
    terms, leaving = legs.scalars, legs.links.at[block]
    for leg, (price, state) in _offers(legs, block, leaving, cost).items():
        plain = None if leaving.everyone else _first_without(states, leaving.measurers[leg])
        if plain is not None:
            plain_price = bases[plain] + terms.own_link[leg]
            if plain_price < price or (plain_price == price and states[plain] < state):
                price, state = plain_price, states[plain]
        total = price + (terms.fixed[leg] + (terms.reach[leg] - block) * terms.block_time[leg])
        if total < cost.item(leg):
            cost[leg], before[leg], entered[leg] = total, state, block


def _first_without(states: list[int], measurers: frozenset[int]) -> int | None:
    """The position of the first state that did not measure a link to the leg, if any."""
    if states[0] not in measurers:
        return 0
    return next((i for i, k in enumerate(states) if k not in measurers), None)


def _offers(legs: Legs, block: int, leaving: LinksAt, cost: Floats) -> dict[int, tuple[float, int]]:
    """Per leg a state measured: its cheapest offer over a measured link, then the lowest state. A server not
    reached costs inf, so its offers never win (and a leg only such servers measured gets none)."""
    can_enter = set(legs.enterable[block].tolist()) if legs.banned else None
    costs = cost[leaving.rows].tolist()
    rows = leaving.row_list  # ascending: the first of the cheapest offers is the lowest state
    offers = {}
    for leg, halves in leaving.halves.items():
        if can_enter is None or leg in can_enter:
            prices = list(map(operator.add, costs, halves))
            price = min(prices)
            if price < math.inf:
                offers[leg] = (price, rows[prices.index(price)])
    return offers


def _update(cost: Floats, before: Ints, entered: Ints, idx: Ints, values: Floats, state: int, block: int) -> None:
    cost[idx] = values
    before[idx] = state
    entered[idx] = block
