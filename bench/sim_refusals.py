"""One simulated run's open refusals for room and ``plan_route`` calls beside its throughput (issue 27's finding:
opens refused by nodes whose announced record still showed room). Not a test: it prints one line.

``python -m bench.sim_refusals [--nodes N] [--seed S]``: the quick 70B steady scenario (``sim/scenarios.py``)."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from gateway.swarm.routing import Hop
from sim import clients
from sim.hardware import LLAMA_70B
from sim.scenario import Scenario, run
from sim.world import Session, World


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    quick = Scenario("70b steady (quick)", model=LLAMA_70B).quick()  # quick() caps the nodes at 40: set after it
    scenario = replace(quick, nodes=args.nodes, seed=args.seed)
    counts = {"refusals": 0, "for_room": 0, "remembered": 0}
    accepts = clients._accepts

    def counting(world: World, session: Session, hop: Hop, avoid: set[str]) -> bool:
        node = world.nodes[hop.peer_id]
        full = not node.gone and node.room() < session.request.max_length
        # A node routed to although this gateway remembers it refusing (every node of some block was short)
        remembered = hop.peer_id in getattr(session.gateway, "refusals", ())  # () before the gateway remembered
        accepted = accepts(world, session, hop, avoid)
        counts["remembered"] += not accepted and remembered
        counts["refusals"] += not accepted
        counts["for_room"] += not accepted and full
        return accepted

    clients._accepts = counting  # counts what the real one decides
    began = time.process_time()
    result = run(scenario)
    cpu = time.process_time() - began
    s = result.summary
    print(
        f"nodes {scenario.nodes} seed {scenario.seed}: open refusals {counts['refusals']} (for room"
        f" {counts['for_room']}; by nodes the gateway remembered refusing {counts['remembered']}),"
        f" plan_route calls {len(result.route_times)} ({sum(result.route_times):.1f} s),"
        f" finished {s['finished']:.0f}, refused sessions {s['refused']:.0f}, ours {s['throughput']:.1f} tok/s,"
        f" bound {s['bound']:.1f}, ours/bound {s['ratio']:.3f}, TTFT p50 {s['ttft_p50']:.2f} s, CPU {cpu:.0f} s"
    )


if __name__ == "__main__":
    main()
