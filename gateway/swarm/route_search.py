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
from dataclasses import dataclass

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

    servers: Sequence[ServerRecord]
    reach: Ints  # the boundary each takes the route to
    block_time: Floats
    fixed: Floats  # the cache penalty, and when pushing from the last hop the half RTT back to the gateway
    own_link: Floats  # the link into it when its predecessor measured none
    enterable: dict[int, Ints]  # per boundary: the servers a route may enter there
    index: dict[str, int]


def usable(servers: Sequence[ServerRecord], banned: frozenset[str], start: int, end: int) -> dict[int, Ints]:
    """Per block, who a route may enter there: its servers less the banned ones, unless every one is banned."""
    if not servers:
        raise MissingBlocks(list(range(start, end)))
    starts = np.array([s.start for s in servers])
    ends = np.array([s.end for s in servers])
    allowed = np.array([s.peer_id not in banned for s in servers])
    blocks = np.arange(start, end)[:, None]
    cover = (starts[None, :] <= blocks) & (ends[None, :] > blocks)  # [blocks, servers]
    missing = [int(b) for b in np.flatnonzero(~cover.any(axis=1)) + start]
    if missing:
        raise MissingBlocks(missing)
    unbanned = cover & allowed[None, :]
    chosen = np.where(unbanned.any(axis=1)[:, None], unbanned, cover)
    return {start + row: np.flatnonzero(mask) for row, mask in enumerate(chosen)}


def cheapest(legs: Legs, start: int, end: int, push: bool) -> list[tuple[int, int, int]]:
    """(server index, from, to) hops of the cheapest route over [start, end)."""
    n = len(legs.servers)
    cost = np.full(n, np.inf)
    before = np.full(n, NO_SERVER, dtype=np.int64)
    entered = np.zeros(n, dtype=np.int64)
    order = np.argsort(legs.reach, kind="stable")
    bounds = np.searchsorted(legs.reach[order], np.arange(start, end + 1))
    for block in range(start, end):
        if block == start:
            states = [NO_SERVER]
        else:
            reached = order[bounds[block - start] : bounds[block - start + 1]]
            reached = reached[np.isfinite(cost[reached])]
            states = reached[np.lexsort((reached, cost[reached]))].tolist()  # cheapest first, then by peer
        if states:
            _relax(legs, block, states, cost, before, entered, push)
    last = int(np.argmin(np.where(legs.reach == end, cost, np.inf)))
    hops = []
    while last != NO_SERVER:
        hops.append((last, int(entered[last]), int(legs.reach[last])))
        last = int(before[last])
    return hops[::-1]


def _relax(legs: Legs, block: int, states: list[int], cost: Floats, before: Ints, entered: Ints, push: bool) -> None:
    """Price every leg enterable at ``block`` from the states that reached it, cheapest first (all final: they
    entered earlier boundaries)."""
    links = {k: _measured(legs, k) if push else {} for k in states}
    best = states[0]
    base = _base(cost, best)
    idx = legs.enterable[block]
    priced = base + legs.fixed[idx] + (legs.reach[idx] - block) * legs.block_time[idx] + legs.own_link[idx]
    special = np.zeros(len(idx), dtype=bool)
    if links[best]:
        by_best = np.zeros(len(legs.servers), dtype=bool)
        by_best[list(links[best])] = True
        special = by_best[idx]
    better = (priced < cost[idx]) & ~special
    _update(cost, before, entered, idx[better], priced[better], best, block)
    # Legs whose price some state's measured link changes: the cheapest of those measured offers and the plain one
    # from the cheapest state that measured nothing to the leg.
    can_enter = np.zeros(len(legs.servers), dtype=bool)
    can_enter[idx] = True
    offers: dict[int, list[tuple[float, int]]] = {}
    for state in states:
        for leg, rtt in links[state].items():
            if can_enter[leg]:
                offers.setdefault(leg, []).append((_base(cost, state) + rtt / 2, state))
    for leg, measured in offers.items():
        plain = next((k for k in states if leg not in links[k]), None)
        if plain is not None:
            measured.append((_base(cost, plain) + float(legs.own_link[leg]), plain))
        total, state = min(measured)
        total += _leg_cost(legs, leg, block)
        if total < cost[leg]:
            _update(cost, before, entered, np.array([leg]), np.array([total]), state, block)


def _base(cost: Floats, state: int) -> float:
    return 0.0 if state == NO_SERVER else float(cost[state])


def _leg_cost(legs: Legs, leg: int, block: int) -> float:
    return float(legs.fixed[leg] + (legs.reach[leg] - block) * legs.block_time[leg])


def _measured(legs: Legs, state: int) -> dict[int, float]:
    """The links ``state``'s server measured to others, by their index (none before the first hop)."""
    if state == NO_SERVER:
        return {}
    rtts = legs.servers[state].next_rtts
    return {legs.index[peer]: rtt for peer, rtt in rtts.items() if peer in legs.index}


def _update(cost: Floats, before: Ints, entered: Ints, idx: Ints, values: Floats, state: int, block: int) -> None:
    cost[idx] = values
    before[idx] = state
    entered[idx] = block
