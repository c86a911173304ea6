"""The data plane's fixed point: the rates it returns are the rounds its own waits give, and a tick that starts from
the last tick's solution lands where a cold solve does."""

from __future__ import annotations

import numpy as np
import pytest

from sim.dataplane import GATEWAY_WORK, Chains, Nodes, solve

NODES = Nodes(fixed=np.array([0.02, 0.03, 0.025]), token_time=np.array([0.0004, 0.0006, 0.0005]))


def chains(sessions: int) -> Chains:
    """``sessions`` sessions, each over nodes 0 -> 1 -> 2 (10 blocks each) or, every third one, 0 -> 2 (15 each)."""
    session: list[int] = []
    node: list[int] = []
    blocks: list[float] = []
    for s in range(sessions):
        hops = [(0, 15.0), (2, 15.0)] if s % 3 == 2 else [(0, 10.0), (1, 10.0), (2, 10.0)]
        for n, b in hops:
            session.append(s)
            node.append(n)
            blocks.append(b)
    return Chains(np.array(session), np.array(node), np.array(blocks), np.full(len(node), 0.01), sessions)


@pytest.mark.parametrize("sessions", [1, 30, 100, 400])  # 400: past MAX_BATCH at every node
def test_each_sessions_rate_is_one_over_its_round_at_the_waits_returned(sessions: int) -> None:
    plane = chains(sessions)
    rates = solve(plane, NODES)
    rounds = (
        np.bincount(plane.session, weights=plane.link + rates.at_node[plane.node], minlength=sessions) + GATEWAY_WORK
    )
    np.testing.assert_allclose(rates.tokens_per_s, 1.0 / rounds, rtol=1e-3)


@pytest.mark.parametrize(("before", "after"), [(400, 420), (100, 90), (30, 60)])
def test_a_warm_tick_after_sessions_come_and_go_lands_where_a_cold_solve_does(before: int, after: int) -> None:
    last = solve(chains(before), NODES)
    warm = solve(chains(after), NODES, last.at_node)
    cold = solve(chains(after), NODES)
    np.testing.assert_allclose(warm.tokens_per_s, cold.tokens_per_s, rtol=1e-3)
