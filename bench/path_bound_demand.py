"""Whether the path LP's optimum (``route_plan.path_lp``) serves a gateway more than its users ask of it: the bound
has no per-gateway demand rows (a chain starts at any gateway), so it could send every token through the best
placed one. The quick 70B steady scenario at 1.2x load: at every path-bound call from ``--from`` on, the optimum's
tokens/s by gateway against the offered load there (users pick the nearest gateway: ``World.gateway_shares``), and
the optimum with each gateway's tokens cut to its offered (a lower figure than the bound would be with the rows, not
a bound). Not a test.

``python -m bench.path_bound_demand [--nodes N] [--seed S] [--from SECONDS]``."""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

import sim.scenario as sim_scenario
from sim.dataflow import path
from sim.hardware import LLAMA_70B
from sim.route_plan.path_lp import PathBound
from sim.scenario import Scenario, run
from sim.world import World


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--from", dest="after", type=float, default=240.0, help="virtual seconds before sampling")
    args = parser.parse_args()
    worlds: list[World] = []
    calls: list[tuple[float, dict[int, float], float]] = []  # (bound, tokens/s by gateway, offered)
    populate = sim_scenario._populate

    def populating(scenario: Scenario) -> World:
        worlds.append(populate(scenario))
        return worlds[-1]

    def keeping(world: World, held_length: float, seconds: float = 60.0) -> PathBound | None:
        found = path(world, held_length, seconds)
        if found is not None and world.clock.now >= args.after:
            by_gateway: dict[int, float] = {}
            for chain, rate in zip(found.used, found.rates, strict=True):
                by_gateway[chain.gateway] = by_gateway.get(chain.gateway, 0.0) + rate
            calls.append((found.tokens_per_s, by_gateway, world.offered(world.clock.now)))
        return found

    sim_scenario._populate, sim_scenario.path = populating, keeping  # type: ignore[attr-defined]
    quick = Scenario("70b steady (quick)", model=LLAMA_70B, load=1.2).quick()
    summary = run(replace(quick, nodes=args.nodes, seed=args.seed)).summary
    world = worlds[-1]
    shares = world.gateway_shares()
    offered = float(np.mean([c[2] for c in calls]))
    print(  # noqa: T201
        f"nodes {args.nodes} seed {args.seed}: ours {summary['throughput']:.0f} tok/s, path bound"
        f" {np.mean([c[0] for c in calls]):.0f} over {len(calls)} calls, offered {offered:.0f}"
    )
    for i, gateway in enumerate(world.gateways):
        planned = np.mean([c[1].get(i, 0.0) for c in calls])
        print(  # noqa: T201
            f"  {gateway.city.name}: users {shares[i]:.3f}, the optimum {planned:.0f} tok/s, offered there"
            f" {offered * shares[i]:.0f}"
        )
    cut = [sum(min(by.get(i, 0.0), off * shares[i]) for i in range(len(shares))) for _, by, off in calls]
    print(f"the optimum cut to each gateway's offered: {np.mean(cut):.0f} tok/s")  # noqa: T201


if __name__ == "__main__":
    main()
