"""Which chains the path LP's optimum runs (``route_plan.path_lp``), to set beside ours (``bench.sim_chains``): the
quick 70B steady scenario at 1.2x load, and at its last path-bound call the LP re-solved over the chains it used:
its tokens/s, mean idle round (weighted by tokens/s), hops a chain, the share of the swarm's KV memory it fills
(block-tokens, as ``bench.sim_chains`` counts ours) and the nodes whose pool or compute row is full. Not a test.

``python -m bench.path_bound_mix [--nodes N] [--seed S] [--until SECONDS]``."""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from scipy.optimize import linprog

import sim.dataflow as dataflow
from sim.hardware import LLAMA_70B
from sim.route_plan.chains import Chain, Floats, Graph
from sim.route_plan.path_lp import PathBound, path_bound
from sim.scenario import Scenario, run

Call = tuple[Graph, Floats, Floats, float, PathBound | None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--until", type=float, default=420.0, help="virtual seconds the run lasts")
    args = parser.parse_args()
    calls: list[Call] = []

    def keeping(
        graph: Graph, capacity: Floats, pool: Floats, held: float, seconds: float = 60.0, start: tuple[Chain, ...] = ()
    ) -> PathBound | None:
        found = path_bound(graph, capacity, pool, held, seconds, start=start)
        calls.append((graph, capacity, pool, held, found))
        return found

    dataflow.path_bound = keeping  # type: ignore[attr-defined,assignment]
    quick = Scenario("70b steady (quick)", model=LLAMA_70B, load=1.2).quick()  # quick() caps the nodes: set after
    run(replace(quick, nodes=args.nodes, seed=args.seed, duration=args.until))
    graph, capacity, pool, held, found = calls[-1]
    if found is None:
        print("pricing gave up")  # noqa: T201
        return
    chains = list(found.used)
    spans = (graph.placement.ends - graph.placement.starts).astype(float)
    count = len(spans)
    rounds = np.array([graph.round(c) for c in chains])
    rows = np.zeros((2 * count, len(chains)))  # scaled to right-hand side 1, as ``path_bound``'s restricted LP
    for j, chain in enumerate(chains):
        for node, blocks in graph.blocks_of(chain):
            rows[node, j] += blocks / (capacity[node] * spans[node])
            rows[count + node, j] += rounds[j] * held * blocks / (spans[node] * pool[node])
    y = linprog(-np.ones(len(chains)), A_ub=rows, b_ub=np.ones(2 * count), method="highs").x
    kv = float(y @ rounds) * held * graph.blocks  # every chain runs every block once
    hops = np.array([len(c.hops) for c in chains])
    print(  # noqa: T201
        f"LP {y.sum():.0f} tok/s (bound {found.tokens_per_s:.0f}, closed {found.closed}) on {int((y > 0).sum())}"
        f" chains: mean round {float(y @ rounds / y.sum()):.3f} s, hops a chain {float(y @ hops / y.sum()):.2f},"
        f" sessions at once {float(y @ rounds):.0f}, KV memory used {kv / float((pool * spans).sum()):.3f};"
        f" pools full {int((rows[count:] @ y > 0.99).sum())} of {count}, compute full"
        f" {int((rows[:count] @ y > 0.99).sum())}"
    )


if __name__ == "__main__":
    main()
