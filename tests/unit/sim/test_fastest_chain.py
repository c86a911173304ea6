"""The fastest chain through each node: the dynamic programme agrees with every chain enumerated by hand."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from sim import geography
from sim.fastest_chain import CITY_INDEX, Placement, fastest_rounds, one_way

GATEWAYS = [(geography.city("Ashburn"), 0.0005), (geography.city("Singapore"), 0.0005)]


def chains(placement: Placement, boundary: int, blocks: int) -> Iterator[list[tuple[int, int]]]:
    """Every chain from ``boundary`` to the end as (node, entry block) hops, each to its node's span end."""
    if boundary == blocks:
        yield []
        return
    for node in range(len(placement.starts)):
        if placement.starts[node] <= boundary < placement.ends[node]:
            for rest in chains(placement, int(placement.ends[node]), blocks):
                yield [(node, boundary), *rest]


def by_hand(placement: Placement, blocks: int) -> list[float]:
    links, p = one_way(), placement
    best = [float("inf")] * len(p.starts)
    for city, last_mile in GATEWAYS:
        gateway = (CITY_INDEX[city.name], last_mile)
        for chain in chains(p, 0, blocks):
            here, cost = gateway, 0.0
            for node, entry in chain:
                cost += here[1] + links[here[0], p.cities[node]] + p.last_miles[node]
                cost += p.fixed[node] + (p.ends[node] - entry) * p.token_time[node]
                here = (int(p.cities[node]), float(p.last_miles[node]))
            cost += here[1] + links[here[0], gateway[0]] + gateway[1]
            for node, _ in chain:
                best[node] = min(best[node], cost)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_the_programme_finds_the_fastest_chain_through_every_node(seed: int) -> None:
    rng = np.random.default_rng(seed)
    blocks, count = 6, int(rng.integers(2, 8))
    starts = rng.integers(0, blocks, count)
    placement = Placement(
        starts,
        np.array([rng.integers(s + 1, blocks + 1) for s in starts]),
        rng.integers(0, len(geography.CITIES), count),
        rng.uniform(0.0, 0.01, count),
        rng.uniform(0.01, 0.05, count),
        rng.uniform(0.0, 0.01, count),
    )
    expected = by_hand(placement, blocks)
    assert fastest_rounds(placement, GATEWAYS, blocks).tolist() == pytest.approx(expected)


def test_a_node_no_chain_can_complete_has_no_round() -> None:
    # Blocks 0:2 and 3:4 are served, 2:3 is not: no chain covers the model.
    placement = Placement(
        np.array([0, 3]), np.array([2, 4]), np.array([0, 0]), np.zeros(2), np.full(2, 0.01), np.zeros(2)
    )
    assert np.isinf(fastest_rounds(placement, GATEWAYS, 4)).all()
