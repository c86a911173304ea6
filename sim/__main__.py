"""``python -m sim [--quick] [--out DIR]``: run the scenarios, write the report (sim/report.py)."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from sim import report, scenarios
from sim.hardware import LLAMA_405B
from sim.route_timing import time_routes
from sim.scenario import run


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two small, short scenarios (tests)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for sim.md and the plots")
    parser.add_argument("--workers", type=int, default=2, help="scenarios run at once (processes)")
    parser.add_argument("--max-nodes", type=int, default=None, help="skip scenarios with more nodes than this")
    args = parser.parse_args()
    chosen = scenarios.quick() if args.quick else scenarios.full()
    chosen = [s for s in chosen if args.max_nodes is None or s.nodes <= args.max_nodes]
    began = time.monotonic()
    # Scenarios are independent (each its own seed and world): one process per core. Biggest first.
    order = sorted(range(len(chosen)), key=lambda i: -chosen[i].nodes * chosen[i].duration)
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        done = dict(zip(order, pool.map(run, [chosen[i] for i in order]), strict=True))
    results = [done[i] for i in range(len(chosen))]
    # Route choice by size, on settled swarms up to the largest size asked for (placement only: cheap at 1,000).
    sizes = [n for n in (40,) if args.quick] or [n for n in (100, 300, 1000) if args.max_nodes is None or n <= 1000]
    route_times = {n: time_routes(LLAMA_405B, n) for n in sizes}
    print(f"{len(results)} scenarios in {time.monotonic() - began:.0f} s wall", flush=True)  # noqa: T201
    command = "python -m sim" + (" --quick" if args.quick else "")
    print(report.write(results, route_times, args.out, command))  # noqa: T201


if __name__ == "__main__":
    main()
