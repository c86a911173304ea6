"""The throughput the same hardware and placement could give at best: a max-flow over block boundaries, as an LP.

Boundaries 0..B are the vertices; a node serving [start, end) offers an edge b -> end from every boundary b of its
span (a route may enter a node mid-span, as ``plan_route``'s may). A token through the edge from b uses
``(end - b)`` of the node's block-steps; a node gives at most ``capacity x span`` block-tokens/s. Maximize the flow
from 0 to B. networkx is not in our environment, and this is not a plain max-flow anyway (several edges share one
node's capacity), so scipy's linprog (HiGHS) solves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix


@dataclass(frozen=True)
class Stage:
    """One node as the bound sees it: its span and the tokens/s it can push through the whole span."""

    start: int
    end: int
    capacity: float


def max_throughput(stages: Sequence[Stage], num_blocks: int) -> float:
    """Tokens/s through blocks [0, num_blocks) at best; 0 when some block has no node."""
    edges = [(i, b) for i, s in enumerate(stages) for b in range(s.start, s.end)]
    if not edges:
        return 0.0
    n = len(edges) + 1  # one variable per edge, the last one the total flow
    rows, cols, vals = [], [], []
    for col, (i, b) in enumerate(edges):
        end = stages[i].end
        rows += [b, end] if b > 0 else [end]  # leaves b (conservation at b unless b is the source), enters end
        cols += [col, col] if b > 0 else [col]
        vals += [-1.0, 1.0] if b > 0 else [1.0]
    # Conservation at 1..B-1 (inflow - outflow = 0) and at B (inflow - total = 0); rows indexed by boundary.
    rows, cols, vals = _drop_source_row(rows, cols, vals)
    rows.append(num_blocks - 1)
    cols.append(n - 1)
    vals.append(-1.0)
    equality = coo_matrix((vals, (rows, cols)), shape=(num_blocks, n))
    use = coo_matrix(
        ([float(stages[i].end - b) for i, b in edges], ([i for i, _ in edges], range(len(edges)))),
        shape=(len(stages), n),
    )
    limits = np.array([s.capacity * (s.end - s.start) for s in stages])
    objective = np.zeros(n)
    objective[-1] = -1.0
    result = linprog(objective, A_ub=use, b_ub=limits, A_eq=equality, b_eq=np.zeros(num_blocks), method="highs")
    return float(-result.fun) if result.status == 0 else 0.0


def _drop_source_row(rows: list[int], cols: list[int], vals: list[float]) -> tuple[list[int], list[int], list[float]]:
    """Boundary b's conservation row is row b - 1 (the source, boundary 0, has none)."""
    return [r - 1 for r in rows], cols, vals
