"""A tighter bound than the per-node relaxation (``dataflow.bound``): the path LP, by column generation.

Variables: y_c >= 0, tokens/s on each chain c (``chains``: gateway, hops over blocks [0, B) to their span
ends, back), at its idle round T_c. At each node n:
- compute: sum_c y_c x blocks_c(n) <= capacity_n x span_n (block-tokens/s, as ``flow_bound``);
- KV room: sum_c y_c x T_c x H x blocks_c(n) / span_n <= pool_n: y_c x T_c sessions are on chain c at once
  (Little's law: a session on it decodes at most 1 / T_c tokens/s), each holding ``max_length x blocks / span``
  of the node's pool (``shared.kv_charge``), weighted by holding time: H = ``workload.mean_request``'s length.
Maximize sum_c y_c. Any routing over the placement whose hops end at span ends (the per-node bound's own scope)
is a feasible point: its sessions run no faster than their chains' idle rounds. Since T_c >= the fastest round
through each of c's nodes, every feasible y also fits the per-node relaxation's limits, so this is never above it.

Why the number returned is an upper bound, whatever the column generation did: with the rows scaled to right-hand
side 1 and duals (pi, mu) >= 0 of the restricted LP, a chain's reduced price is ``f_c = A_c + T_c x M_c`` (A, M
add over hops: ``chain_pricing``), and (pi, mu) / kappa is feasible for the dual of the LP over EVERY chain when
kappa <= min_c f_c. By weak duality, (sum pi + sum mu) / min(1, kappa) bounds that LP. Pricing is exact
(``chain_pricing.price``: label setting with dominance), so kappa is the true minimum; the bound returned is the
least of these over the iterations, and equals the LP's optimum once no chain prices below 1. When pricing would
keep too many labels (``TooManyLabels``) there is no bound: ``path_bound`` returns None and callers keep the
per-node figure. The cheap rounds that only look for new chains price at duals smoothed over the iterations
(``SMOOTH``); that changes which chains enter, never the bound (exact pricing is at the restricted LP's own duals).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from sim.route_plan.chains import Chain, Floats, Graph, TooManyLabels, price

IDLE = 20  # restricted LPs a chain may stay unused in before it leaves
GAP = 1e-6  # stop once the bound is within this share of the restricted LP's throughput
PER_ROUND = 200  # chains added per iteration at most
BEAM = 16  # labels a node keeps in the cheap pricing rounds (``chain_pricing.price``)
SLACK = 1e-9  # a chain enters only if its price is below 1 by more than this (solver tolerances)
# The cheap rounds price at duals smoothed over iterations (this share the last pricing point's, the rest the new
# restricted LP's): raw duals jump from one extreme point to another, and the columns found there often go unused.
SMOOTH = 0.5
UNMET = 1e3  # ``fastest_plan``'s price of a token/s of demand left unmet (a chain's round is seconds)


@dataclass(frozen=True)
class PathBound:
    tokens_per_s: float  # the upper bound (see the module's docstring)
    reached: float  # the restricted LP's optimum: what routing the chains found could carry at best
    chains: int  # columns generated (some left the restricted LP again, unused)
    iterations: int
    closed: bool  # whether the gap closed (else tokens_per_s is still a bound, a looser one)
    # the chains the restricted LP's optimum runs: a start for the next call
    used: tuple[Chain, ...] = field(default=(), repr=False)
    rates: tuple[float, ...] = field(default=(), repr=False)  # tokens/s on each of ``used`` there
    known: tuple[Chain, ...] = field(default=(), repr=False)  # every chain of the last restricted LP, used or not


def path_bound(
    graph: Graph,
    capacity: Floats,
    pool: Floats,
    held_length: float,
    seconds: float = 60.0,
    iterations: int = 500,
    start: tuple[Chain, ...] = (),
) -> PathBound | None:
    """The path LP's bound in tokens/s; ``capacity`` (tokens/s through the whole span) and ``pool`` (KV tokens),
    per node, both > 0. ``start``: chains to begin with, all in the first restricted LP (an earlier call's
    ``used``, the chains sessions run on: it saves iterations, and changes nothing in the bound; those no longer on
    the placement are left out). None if pricing gave up
    (``TooManyLabels``)."""
    spans = (graph.placement.ends - graph.placement.starts).astype(float)
    per_block_compute = 1.0 / (capacity * spans)  # a row's scale: right-hand side 1
    per_block_kv = held_length / (spans * pool)
    count = len(spans)
    began = time.process_time()
    try:
        _, priced = price(graph, np.zeros(count), np.zeros(count), 1.0)
        chains = [c for _, c in priced] + [c for c in start if graph.holds(c)]
        if not chains:
            return PathBound(0.0, 0.0, 0, 0, True)  # no chain covers every block
        columns: dict[Chain, _Column] = {}
        best, reached, done, made = np.inf, 0.0, 0, 0
        center: tuple[Floats, Floats] | None = None
        while True:
            entering = chains if start else chains[:PER_ROUND]  # the first round: every chain given, and the fastest
            for chain in entering:
                columns[chain] = _column(graph, chain, per_block_compute, per_block_kv)
            made, start = made + len(entering), ()
            reached, pi, mu, used, rates = _solve(columns, count)
            a, m = pi * per_block_compute, mu * per_block_kv
            done += 1
            chains = []
            if SMOOTH > 0 and center is not None:  # cheap: new chains, no bound; kept if they price below 1 at (a, m)
                center = (SMOOTH * center[0] + (1 - SMOOTH) * a, SMOOTH * center[1] + (1 - SMOOTH) * m)
                _, priced = price(graph, *center, 1.0, keep=2 * PER_ROUND, beam=BEAM)
                chains = [c for _, c in priced if c not in columns and _price(graph, c, a, m) < 1.0 - SLACK]
            else:
                center = (a, m)
            if not chains:  # none there: at the restricted LP's own duals
                _, priced = price(graph, a, m, 1.0, keep=2 * PER_ROUND, beam=BEAM)
                chains = [c for f, c in priced if f < 1.0 - SLACK and c not in columns]
            if chains and done < iterations and time.process_time() - began < seconds:
                continue
            least, priced = price(graph, a, m, 1.0, keep=2 * PER_ROUND)  # exact: a bound
            if least > 0:  # 0 only where some chain's nodes all have zero duals: no bound this round
                best = min(best, float(pi.sum() + mu.sum()) / least)
            chains = [c for f, c in priced if f < 1.0 - SLACK and c not in columns]
            closed = least >= 1.0 - SLACK or best <= reached * (1 + GAP)
            if closed or not chains or done >= iterations or time.process_time() - began > seconds:
                return PathBound(float(best), reached, made, done, closed, used, rates, tuple(columns))
    except TooManyLabels:
        return None


def fastest_plan(
    graph: Graph, capacity: Floats, pool: Floats, held_length: float, chains: tuple[Chain, ...], demand: Floats
) -> tuple[tuple[Chain, ...], tuple[float, ...]]:
    """Tokens/s per chain that carry ``demand`` (tokens/s per gateway) within the same compute and KV rows as the
    path LP with the fewest sessions at once: minimise sum_c y_c x T_c (Little's law), so the fastest chains first.
    Over ``chains`` (the path LP's) and each gateway's fastest chains through each last node (``price`` with every
    block's KV price 1 / B: f = T). Demand a gateway's chains cannot carry is left unmet at a price
    (``UNMET``) no chain's round comes near. The path LP's optimum spreads sessions over slow chains wherever that
    adds throughput; below it a plan has no reason to. Returns (chains used, their tokens/s)."""
    _, fastest = price(graph, np.zeros(len(capacity)), np.full(len(capacity), 1.0 / graph.blocks), np.inf)
    chains = tuple(dict.fromkeys([*chains, *(c for _, c in fastest)]))
    spans = (graph.placement.ends - graph.placement.starts).astype(float)
    per_block_compute, per_block_kv = 1.0 / (capacity * spans), held_length / (spans * pool)
    listed = [_column(graph, chain, per_block_compute, per_block_kv) for chain in chains]
    count, gateways = len(spans), len(demand)
    # columns: y per chain, then unmet demand per gateway; rows: compute, KV, then - carried - unmet <= - demand
    rows = [r for c in listed for r in c.rows] + [2 * count + c.gateway for c in chains]
    rows += [2 * count + g for g in range(gateways)]
    cols = [i for i, c in enumerate(listed) for _ in c.rows] + list(range(len(chains)))
    cols += [len(chains) + g for g in range(gateways)]
    vals = [v for c in listed for v in c.vals] + [-1.0] * (len(chains) + gateways)
    matrix = coo_matrix((vals, (rows, cols)), shape=(2 * count + gateways, len(chains) + gateways)).tocsr()
    costs = np.append([graph.round(chain) for chain in chains], np.full(gateways, UNMET))
    limits = np.append(np.ones(2 * count), -np.asarray(demand))
    result = linprog(costs, A_ub=matrix, b_ub=limits, method="highs")
    if result.status != 0:
        raise RuntimeError(f"fastest plan: {result.message}")
    kept = [(chain, float(y)) for chain, y in zip(chains, result.x[: len(chains)], strict=True) if y > 0]
    return tuple(c for c, _ in kept), tuple(y for _, y in kept)


def _price(graph: Graph, chain: Chain, a: Floats, m: Floats) -> float:
    used = graph.blocks_of(chain)
    return sum(float(a[n]) * k for n, k in used) + graph.round(chain) * sum(float(m[n]) * k for n, k in used)


@dataclass
class _Column:
    rows: list[int]
    vals: list[float]
    idle: int = 0  # restricted LPs solved in a row with this chain unused


def _column(graph: Graph, chain: Chain, per_block_compute: Floats, per_block_kv: Floats) -> _Column:
    held = graph.round(chain)
    count = len(per_block_compute)
    column = _Column([], [])
    for node, blocks in graph.blocks_of(chain):
        column.rows += [node, count + node]
        column.vals += [blocks * float(per_block_compute[node]), held * blocks * float(per_block_kv[node])]
    return column


def _solve(
    columns: dict[Chain, _Column], count: int
) -> tuple[float, Floats, Floats, tuple[Chain, ...], tuple[float, ...]]:
    """The restricted LP: (its throughput, compute duals, KV duals, the chains it runs, their tokens/s), duals
    clipped to >= 0.
    Chains unused for ``IDLE`` solves in a row leave it, so that it stays small (any may come back: pricing sees
    every chain)."""
    listed = list(columns.values())
    rows = [r for c in listed for r in c.rows]
    cols = [i for i, c in enumerate(listed) for _ in c.rows]
    vals = [v for c in listed for v in c.vals]
    matrix = coo_matrix((vals, (rows, cols)), shape=(2 * count, len(listed))).tocsr()
    result = linprog(-np.ones(len(listed)), A_ub=matrix, b_ub=np.ones(2 * count), method="highs")
    if result.status != 0:
        raise RuntimeError(f"restricted LP: {result.message}")
    used = tuple(chain for chain, y in zip(list(columns), result.x, strict=True) if y > 0)
    rates = tuple(float(y) for y in result.x if y > 0)
    for chain, column, y in zip(list(columns), listed, result.x, strict=True):
        column.idle = 0 if y > 0 else column.idle + 1
        if column.idle > IDLE:
            del columns[chain]
    duals = np.maximum(0.0, -np.asarray(result.ineqlin.marginals))
    return float(-result.fun), duals[:count], duals[count:], used, rates
