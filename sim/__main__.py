"""``python -m sim [--quick] [--out DIR]``: run the scenarios, write the report (sim/report.py)."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from sim import report, scenarios
from sim.scenario import run


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two small, short scenarios (tests)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for sim.md and the plots")
    parser.add_argument("--workers", type=int, default=2, help="scenarios run at once (processes)")
    args = parser.parse_args()
    chosen = scenarios.quick() if args.quick else scenarios.full()
    began = time.monotonic()
    # Scenarios are independent (each its own seed and world): one process per core. Biggest first.
    order = sorted(range(len(chosen)), key=lambda i: -chosen[i].nodes * chosen[i].duration)
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        done = dict(zip(order, pool.map(run, [chosen[i] for i in order]), strict=True))
    results = [done[i] for i in range(len(chosen))]
    route_times: dict[int, list[float]] = {}
    for result in results:
        if result.scenario.event is None and result.scenario.slow_share == 0:
            route_times.setdefault(result.scenario.nodes, []).extend(result.route_times)
    print(f"{len(results)} scenarios in {time.monotonic() - began:.0f} s wall", flush=True)  # noqa: T201
    command = "python -m sim" + (" --quick" if args.quick else "")
    print(report.write(results, route_times, args.out, command))  # noqa: T201


if __name__ == "__main__":
    main()
