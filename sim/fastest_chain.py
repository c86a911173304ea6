"""Per serving node, the fastest round any chain through it could make on the placement as it is: a lower bound on
the seconds per token of every session it carries, for the KV-limited bound (``dataflow.bound``).

A chain starts and ends at one gateway and covers blocks [0, B) with hops that end where their node's span ends
(as ``plan_route``'s and the bound's LP do); it pays the gateway's work, half a round trip per link (gateway →
first → … → last → gateway, from ``geography``: the cities' fibre term plus both last miles) and, per hop, one
decode step with one row (``hardware``: the least a token can spend at a node). The best chain is found by dynamic
programming over block boundaries, once forward (the cheapest way to the end of each node's span) and once backward
(the cheapest way on from there), per gateway; links depend on a node only through its city and its last mile, so
each boundary keeps the best cost per city. Load, queues and KV room are ignored: idle, the swarm is fastest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sim import geography
from sim.geography import City
from sim.route_plan.chains import Graph, Spans

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
CITY_INDEX = {c.name: i for i, c in enumerate(geography.CITIES)}


@dataclass(frozen=True)
class Placement:
    """Serving nodes as arrays: span, city (index into ``geography.CITIES``), one-way last mile, and one step's
    cost: ``fixed + blocks x token_time`` seconds for a hop of ``blocks`` blocks."""

    starts: Ints
    ends: Ints
    cities: Ints
    last_miles: Floats
    fixed: Floats
    token_time: Floats


def one_way() -> Floats:
    """Seconds between cities, one way, without last miles: half of ``geography.rtt``'s fibre term."""
    cities = geography.CITIES
    return np.array([[geography.rtt(a, b, 0.0, 0.0) / 2 for b in cities] for a in cities])


def chain_graph(placement: Placement, gateways: Sequence[tuple[int, float]], blocks: int, work: float) -> Graph:
    """The path LP's chains over the placement from gateways at ``(city index, one-way last mile)``: links are
    ``one_way`` plus both last miles."""
    p, links = placement, one_way()
    between = links[p.cities][:, p.cities] + p.last_miles[:, None] + p.last_miles[None, :]
    legs = np.stack([links[city, p.cities] + mile + p.last_miles for city, mile in gateways])
    return Graph.of(Spans(p.starts, p.ends, p.fixed, p.token_time), between, legs, blocks, work)


def fastest_rounds(placement: Placement, gateways: Sequence[tuple[City, float]], blocks: int) -> Floats:
    """Per node, seconds of the fastest chain through it from any gateway (``(city, last mile)``), less the
    gateway's own work; ``inf`` where no chain through it covers every block."""
    links = one_way()
    best = np.full(len(placement.starts), np.inf)
    for city, last_mile in gateways:
        gateway = (CITY_INDEX[city.name], last_mile)
        forward = _to_span_ends(placement, links, gateway, blocks)
        backward = _from_span_ends(placement, links, gateway, blocks)
        best = np.minimum(best, forward + backward)
    return best


def _step(placement: Placement, node: int, entries: Ints) -> Floats:
    return placement.fixed[node] + (placement.ends[node] - entries) * placement.token_time[node]


def _to_span_ends(placement: Placement, links: Floats, gateway: tuple[int, float], blocks: int) -> Floats:
    """Per node, the cheapest cost from the gateway to the end of its span through it (its step included)."""
    p = placement
    arrive = np.full((blocks + 1, len(links)), np.inf)  # best cost at boundary b leaving from a node in city c
    arrive[0, gateway[0]] = gateway[1]
    into = np.full((blocks + 1, len(links)), np.inf)  # ... and on into city c (the fibre term added)
    into[0] = (arrive[0][:, None] + links).min(axis=0)
    cost = np.full(len(p.starts), np.inf)
    by_end = np.argsort(p.ends, kind="stable")
    position = 0
    for boundary in range(1, blocks + 1):
        while position < len(by_end) and p.ends[by_end[position]] == boundary:
            node = int(by_end[position])
            entries = np.arange(p.starts[node], boundary)
            cost[node] = p.last_miles[node] + float((into[entries, p.cities[node]] + _step(p, node, entries)).min())
            arrive[boundary, p.cities[node]] = min(arrive[boundary, p.cities[node]], cost[node] + p.last_miles[node])
            position += 1
        into[boundary] = (arrive[boundary][:, None] + links).min(axis=0)
    return cost


def _from_span_ends(placement: Placement, links: Floats, gateway: tuple[int, float], blocks: int) -> Floats:
    """Per node, the cheapest cost from the end of its span back to the gateway (later hops' steps included)."""
    p = placement
    cost = np.where(p.ends == blocks, p.last_miles + links[p.cities, gateway[0]] + gateway[1], np.inf)
    for boundary in range(blocks - 1, 0, -1):
        ending = np.flatnonzero(p.ends == boundary)
        if not len(ending):
            continue
        entering = np.flatnonzero((p.starts <= boundary) & (p.ends > boundary))
        if not len(entering):
            continue
        onward = p.last_miles[entering] + p.fixed[entering] + (p.ends[entering] - boundary) * p.token_time[entering]
        onward = onward + cost[entering]
        per_city = np.full(len(links), np.inf)
        np.minimum.at(per_city, p.cities[entering], onward)
        out_of = (links + per_city[None, :]).min(axis=1)  # from city c to the best next hop
        cost[ending] = p.last_miles[ending] + out_of[p.cities[ending]]
    return cost
