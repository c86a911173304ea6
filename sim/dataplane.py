"""Token rates of the decoding sessions, as a fluid model of a closed queueing network (mean-value analysis).

Each session has one token in flight: its rate is 1 / (the round of its chain) = 1 / (gateway work + the links
of each hop + the time the token spends at each node). A node runs continuous batching: a token that arrives waits
for the step under way (half a step on average), then rides one step with the others present, at most
``MAX_BATCH`` rows (more present: they wait whole steps). Who is present follows from the rates (Little's law:
present = arrivals/s x time there), so the rates are a fixed point, found by damped iteration. Step times come
from ``hardware.NodeHardware``: the cost model nodes announce their throughput by, and routing prices hops with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sim.hardware import MAX_BATCH

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
GATEWAY_WORK = 0.005  # seconds per token at the gateway: embeddings, LM head, sampling
ITERATIONS = 60
DAMPING = 0.5
LEAST_WAIT = 1.5  # steps a token spends at a node at least: half the step under way, then its own


@dataclass(frozen=True)
class Chains:
    """The decoding sessions' hops, flattened: hop h belongs to session ``session[h]`` and runs on ``node[h]``."""

    session: Ints
    node: Ints
    blocks: Floats  # blocks the hop runs
    link: Floats  # seconds of links charged to the hop (into it, and back to the gateway after the last)
    sessions: int


@dataclass(frozen=True)
class Nodes:
    """Per node: what one step costs (``hardware.NodeHardware.step_time``'s terms), times any slowdown."""

    fixed: Floats  # overhead + span x weight-read time, seconds
    token_time: Floats  # seconds one row adds per block


@dataclass(frozen=True)
class Rates:
    tokens_per_s: Floats  # per session
    present: Floats  # per node: tokens at it on average
    at_node: Floats  # per node: seconds a token spends there (the wait and its step)


def solve(chains: Chains, nodes: Nodes, start: Floats | None = None) -> Rates:
    """``start``: seconds a token spent at each node in the last solution (the next one starts from there).

    ``ITERATIONS`` damped iterations whether it starts warm or cold: fewer from a warm start (12) were tried and
    left rates 1 % off where sessions come and go, for 1 % of the simulator's CPU."""
    count = len(nodes.fixed)
    if chains.sessions == 0:
        return Rates(np.zeros(0), np.zeros(count), nodes.fixed * 1.5)
    at_node = nodes.fixed * 1.5 if start is None else start  # idle: half a step waited, one step ridden
    links = np.bincount(chains.session, weights=chains.link, minlength=chains.sessions) + GATEWAY_WORK
    for _ in range(ITERATIONS):
        rounds = links + np.bincount(chains.session, weights=at_node[chains.node], minlength=chains.sessions)
        rates = 1.0 / rounds
        per_hop = rates[chains.session]
        arrivals = np.bincount(chains.node, weights=per_hop, minlength=count)
        block_rows = np.bincount(chains.node, weights=per_hop * chains.blocks, minlength=count)
        blocks_per_row = np.divide(block_rows, arrivals, out=np.zeros(count), where=arrivals > 0)
        present = arrivals * at_node
        rows = np.minimum(present, MAX_BATCH)
        step = nodes.fixed + rows * blocks_per_row * nodes.token_time
        waits = LEAST_WAIT - 1.0 + np.maximum(1.0, present / MAX_BATCH)  # the step under way, then the steps it needs
        at_node = DAMPING * at_node + (1 - DAMPING) * step * waits
    return Rates(np.asarray(rates, dtype=np.float64), present, at_node)
