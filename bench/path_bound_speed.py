"""What the path LP's bound (``route_plan.path_lp``) costs a call as a run makes them: a settled swarm (placed by our
span choice, churn on, no traffic), one call every 15 virtual seconds, each starting from the last one's chains
(``sim.dataflow.path``: those still on the placement), the first cold. Not a test: it prints a line per call.

``python -m bench.path_bound_speed [--nodes N] [--model 70b|405b] [--seed S] [--calls K] [--seconds CPU]``."""

from __future__ import annotations

import argparse
import time

from sim.dataflow import bound, path
from sim.hardware import LLAMA_70B, LLAMA_405B
from sim.scenario import BOUND_EVERY, Scenario, settle
from sim.workload import mean_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--model", choices=("70b", "405b"), default="70b")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--at", type=float, default=330.0, help="virtual seconds of the first call")
    parser.add_argument("--seconds", type=float, default=60.0, help="CPU allowance a call (as in a run)")
    args = parser.parse_args()
    model = LLAMA_70B if args.model == "70b" else LLAMA_405B
    world = settle(Scenario("speed", model=model, nodes=args.nodes, seed=args.seed), args.at)
    _, held_length = mean_request()
    for call in range(args.calls):
        if call:
            world.clock.run_until(args.at + call * BOUND_EVERY)
        began = time.process_time()
        found = path(world, held_length, args.seconds)
        spent = time.process_time() - began
        node = bound(world, held_length)[0]
        text = "pricing gave up" if found is None else (
            f"bound {found.tokens_per_s:.0f} tok/s, reached {found.reached:.0f},"
            f" {'closed' if found.closed else 'open'}, {found.iterations} iterations, {found.chains} chains"
        )  # fmt: skip
        print(  # noqa: T201
            f"t={world.clock.now:.0f} s, {len(world.serving())} serving: {text}; per-node {node:.0f};"
            f" CPU {spent:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
