"""``python -m sim [--quick] [--out DIR] [--seed S]``: run the scenarios, write the report (sim/report.py).

On a small machine the full set runs in parts: ``--nodes N --save FILE`` runs the scenarios of one size and keeps
their results; ``--report-from FILE...`` writes the report of the parts together."""

from __future__ import annotations

import argparse
import pickle
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from sim import report, scenarios
from sim.hardware import LLAMA_405B
from sim.route_timing import time_routes
from sim.scenario import Result, Scenario, run


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two small, short scenarios (tests)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for sim.md and the plots")
    parser.add_argument("--workers", type=int, default=2, help="scenarios run at once (processes)")
    parser.add_argument("--max-nodes", type=int, default=None, help="skip scenarios with more nodes than this")
    parser.add_argument("--nodes", type=int, default=None, help="run only the scenarios of this many nodes")
    parser.add_argument("--only", default=None, help="run only the scenarios whose name contains this")
    parser.add_argument("--seed", type=int, default=None, help="run the scenarios with this seed, not their own")
    parser.add_argument("--save", type=Path, default=None, help="keep the results here (pickle) instead of a report")
    parser.add_argument("--report-from", type=Path, nargs="+", default=None, help="saved results to report on")
    args = parser.parse_args()
    began = time.monotonic()
    if args.report_from:
        results = [r for path in args.report_from for r in pickle.loads(path.read_bytes())]
    else:
        chosen = scenarios.quick() if args.quick else scenarios.full()
        chosen = [s for s in chosen if (args.max_nodes is None or s.nodes <= args.max_nodes)]
        chosen = [s for s in chosen if args.only is None or args.only in s.name]
        chosen = [s if args.seed is None else replace(s, seed=args.seed) for s in chosen]
        results = _run_all([s for s in chosen if args.nodes is None or s.nodes == args.nodes], args.workers)
        print(f"{len(results)} scenarios in {time.monotonic() - began:.0f} s wall", flush=True)  # noqa: T201
        if args.save:
            args.save.write_bytes(pickle.dumps(results))
            return
    # Route choice by size, on settled swarms (placement only: cheap at 1,000).
    sizes = [40] if args.quick else [n for n in (100, 300, 1000) if args.max_nodes is None or n <= args.max_nodes]
    route_times = {n: time_routes(LLAMA_405B, n) for n in sizes}
    command = "python -m sim" + (" --quick" if args.quick else "")
    print(report.write(results, route_times, args.out, command))  # noqa: T201


def _run_all(chosen: list[Scenario], workers: int) -> list[Result]:
    """Scenarios are independent (each its own seed and world): one process per core, biggest first."""
    order = sorted(range(len(chosen)), key=lambda i: -chosen[i].nodes * chosen[i].duration)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        done = dict(zip(order, pool.map(run, [chosen[i] for i in order]), strict=True))
    return [done[i] for i in range(len(chosen))]


if __name__ == "__main__":
    main()
