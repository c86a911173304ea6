"""The max-flow bound on swarms small enough to work out by hand."""

from __future__ import annotations

import pytest

from sim.flow_bound import Stage, max_throughput


def test_one_node_is_its_capacity_and_a_chain_its_slowest_stage() -> None:
    assert max_throughput([Stage(0, 4, 10.0)], 4) == pytest.approx(10.0)
    assert max_throughput([Stage(0, 2, 10.0), Stage(2, 4, 4.0)], 4) == pytest.approx(4.0)


def test_replicas_add_up() -> None:
    # Two full nodes and a split pair: 10 + 10 + min(10, 10).
    stages = [Stage(0, 2, 10.0), Stage(0, 2, 10.0), Stage(0, 1, 10.0), Stage(1, 2, 10.0)]
    assert max_throughput(stages, 2) == pytest.approx(30.0)


def test_a_route_may_enter_a_node_mid_span() -> None:
    # A serves 0:4 (40 block-tokens/s), B 0:2 (20). y tokens/s go B then A from block 2 (2 of A's block-steps each),
    # the rest all through A (4 each): 4(F - y) + 2y <= 40 and 2y <= 20, so F = 15 at y = 10.
    assert max_throughput([Stage(0, 4, 10.0), Stage(0, 2, 10.0)], 4) == pytest.approx(15.0)


def test_an_uncovered_block_gives_nothing() -> None:
    assert max_throughput([Stage(0, 1, 5.0)], 2) == 0.0
    assert max_throughput([], 2) == 0.0
