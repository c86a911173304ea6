"""The route search behind ``routing.plan_route``, over arrays: fast enough for a swarm of a thousand nodes.

A route goes forward only (a server entered at boundary ``b`` takes it to ``min(end, server.end) > b``), so the
boundaries form a DAG and the cheapest route is a dynamic programme over them in increasing order — no heap. The
state after a hop is the server that made it (its cost to the next one depends on it when pushing). Each boundary
relaxes its servers once, as arrays, from the cheapest state that reached it; a state changes the price of a leg
only for the few nodes it measured (``next_rtts``), and those legs are priced one by one. The simple search this
replaced (a Dijkstra relaxing every server from every state, in Python) took 75 ms per route at 1,000 nodes
without push and 475 ms with it (the simulator's finding, ``bench/results/sim.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shared.errors import MissingBlocks
from shared.server_records import ServerRecord

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
NO_SERVER = -1  # the state before the first hop


@dataclass(frozen=True)
class Legs:
    """The servers a route may use, in peer order, with the parts of ``routing.hop_cost`` that do not depend on
    where the route enters them: a leg entered at ``b`` costs ``fixed + (reach - b) * block_time + link``."""

    links: Sequence[dict[int, float]]  # ServerTable.links
    measured: npt.NDArray[np.bool_]  # ServerTable.measured
    reach: Ints  # the boundary each takes the route to
    block_time: Floats
    fixed: Floats  # the cache penalty, and when pushing from the last hop the half RTT back to the gateway
    own_link: Floats  # the link into it when its predecessor measured none
    enterable: dict[int, Ints]  # per boundary: the servers a route may enter there


@dataclass(frozen=True)
class ServerTable:
    """Servers as arrays, in peer order: built once per view (and adapter), shared by every route planned on it."""

    servers: Sequence[ServerRecord]
    starts: Ints
    ends: Ints
    throughput: Floats
    cache_left: Ints
    peers: list[str]
    links: list[dict[int, float]]  # per server: the RTTs it measured to others (``next_rtts``), by their row
    measured: npt.NDArray[np.bool_]  # per server: whether it measured any link
    covers: dict[tuple[int, int], dict[int, Ints]] = field(default_factory=dict)  # ``_cover``'s, by block range


def table_of(servers: Sequence[ServerRecord]) -> ServerTable:
    ordered = sorted(servers, key=lambda s: s.peer_id)
    index = {s.peer_id: i for i, s in enumerate(ordered)}
    links = [{index[p]: rtt for p, rtt in s.next_rtts.items() if p in index} if s.next_rtts else {} for s in ordered]
    return ServerTable(
        ordered,
        np.array([s.start for s in ordered], dtype=np.int64),
        np.array([s.end for s in ordered], dtype=np.int64),
        np.array([s.throughput for s in ordered], dtype=np.float64),
        np.array([s.cache_tokens_left for s in ordered], dtype=np.int64),
        [s.peer_id for s in ordered],
        links,
        np.array([bool(row) for row in links], dtype=bool),
    )


def overlapping(table: ServerTable, start: int, end: int, excluded: frozenset[str] = frozenset()) -> ServerTable:
    """The servers of some block of [start, end), less the ``excluded`` (a whole route with nobody excluded keeps
    the view's table)."""
    keep = (table.starts < end) & (table.ends > start)
    if excluded:
        keep &= np.array([p not in excluded for p in table.peers], dtype=bool)
    rows = np.flatnonzero(keep)
    if len(rows) == len(table.servers):
        return table
    return table_of([table.servers[int(i)] for i in rows])


def usable(table: ServerTable, banned: frozenset[str], start: int, end: int) -> dict[int, Ints]:
    """Per block, who a route may enter there: its servers less the banned ones, unless every one is banned."""
    cover = _cover(table, start, end)
    if not banned:
        return cover
    allowed = np.array([p not in banned for p in table.peers], dtype=bool)
    chosen = {}
    for block, servers in cover.items():
        kept = servers[allowed[servers]]
        chosen[block] = kept if len(kept) else servers
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
    bounds = np.searchsorted(legs.reach[order], np.arange(start, end + 1))
    for block in range(start, end):
        states = (
            [NO_SERVER]
            if block == start
            else _states(legs, order[bounds[block - start] : bounds[block - start + 1]], cost, push)
        )
        if states:
            _relax(legs, block, states, cost, before, entered, push)
    last = int(np.argmin(np.where(legs.reach == end, cost, np.inf)))
    hops = []
    while last != NO_SERVER:
        hops.append((last, int(entered[last]), int(legs.reach[last])))
        last = int(before[last])
    return hops[::-1]


def _states(legs: Legs, reached: Ints, cost: Floats, push: bool) -> list[int]:
    """The servers whose legs end at a boundary and were reached, cheapest first, then by peer. Only the cheapest
    prices the legs from there unless some measured links (``_relax``): then all of them, in that order."""
    reached = reached[np.isfinite(cost[reached])]  # in peer order: ``order`` sorts by reach stably
    if not len(reached):
        return []
    if push and legs.measured[reached].any():
        return reached[np.lexsort((reached, cost[reached]))].tolist()
    return [int(reached[cost[reached].argmin()])]  # the first of the cheapest: the lowest peer


def _relax(legs: Legs, block: int, states: list[int], cost: Floats, before: Ints, entered: Ints, push: bool) -> None:
    """Price every leg enterable at ``block`` from the states that reached it, cheapest first (all final: they
    entered earlier boundaries)."""
    links = {k: _measured(legs, k) if push else {} for k in states}
    best = states[0]
    base = _base(cost, best)
    idx = legs.enterable[block]
    priced = base + legs.fixed[idx] + (legs.reach[idx] - block) * legs.block_time[idx] + legs.own_link[idx]
    better = priced < cost[idx]
    if links[best]:
        by_best = np.zeros(len(legs.reach), dtype=bool)
        by_best[list(links[best])] = True
        better &= ~by_best[idx]  # the best state's measured legs are priced below
    _update(cost, before, entered, idx[better], priced[better], best, block)
    if any(links.values()):
        _relax_measured(legs, block, states, links, cost, before, entered)


def _relax_measured(
    legs: Legs, block: int, states: list[int], links: dict[int, dict[int, float]], cost: Floats, before: Ints,
    entered: Ints,
) -> None:  # fmt: skip
    """Legs whose price some state's measured link changes: the cheapest of those measured offers and the plain one
    from the cheapest state that measured nothing to the leg."""
    can_enter = set(legs.enterable[block].tolist())
    offers: dict[int, tuple[float, int]] = {}  # per leg: the cheapest measured offer, then the lowest state
    for state in states:
        base = _base(cost, state)
        for leg, rtt in links[state].items():
            if leg in can_enter:
                offer = (base + rtt / 2, state)
                if leg not in offers or offer < offers[leg]:
                    offers[leg] = offer
    for leg, offer in offers.items():
        plain = next((k for k in states if leg not in links[k]), None)
        if plain is not None:
            offer = min(offer, (_base(cost, plain) + float(legs.own_link[leg]), plain))
        total = offer[0] + _leg_cost(legs, leg, block)
        if total < cost[leg]:
            cost[leg], before[leg], entered[leg] = total, offer[1], block


def _base(cost: Floats, state: int) -> float:
    return 0.0 if state == NO_SERVER else float(cost[state])


def _leg_cost(legs: Legs, leg: int, block: int) -> float:
    return float(legs.fixed[leg] + (legs.reach[leg] - block) * legs.block_time[leg])


def _measured(legs: Legs, state: int) -> dict[int, float]:
    """The links ``state``'s server measured to others, by their index (none before the first hop)."""
    return {} if state == NO_SERVER else legs.links[state]


def _update(cost: Floats, before: Ints, entered: Ints, idx: Ints, values: Floats, state: int, block: int) -> None:
    cost[idx] = values
    before[idx] = state
    entered[idx] = block
