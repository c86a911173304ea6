"""Where a KV-bound simulated swarm's throughput goes: the decoding sessions' chains and the KV they hold, sampled
every 30 s over the steady window of the quick 70B steady scenario (``sim/scenarios.py``) at 1.2x load (``--load``).
Not a test: it prints a few lines. Sampling reads the world and changes nothing in it.

``python -m bench.sim_chains [--nodes N] [--seed S] [--load L] [--oracle-next-rtts] [--planned-routing]``. Printed:
ours and the bound (the path LP's, ``route_plan.path_lp``; the per-node one beside it); per decoding session its hops
and the share of hops that use part of their node's span, the swarm's KV memory the sessions use (block-tokens) and
the share its pools charge; a session's round (seconds per token) as the data plane gives it, its chain's idle round
(links plus 1.5 steps a hop), its links and its max_length, and the path bound with the served sessions' mean
max_length as H (the bound's H is the arrivals'); what ``plan_route`` picks on the same placement with every node's
room ignored, and the fastest chain the bound credits (``sim/fastest_chain.py``). Every 30 virtual seconds it says
on stderr how far the run has got and the CPU it has taken (in all, in ``plan_route`` calls and in the path bound).
``--oracle-next-rtts``: every node announces the true RTT to every server of its end block (swarm_node measures 4).
``--planned-routing``: whole chains routed by each gateway's own plan (``route_plan.view_plan``), not ``plan_route``."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import numpy as np

import sim.scenario as sim_scenario
from gateway.swarm.routing import Hop, RouteRequest, plan_route
from shared.server_records import NodeState
from sim import swarm
from sim.dataflow import fastest_rounds, path
from sim.dataplane import GATEWAY_WORK, LEAST_WAIT
from sim.hardware import LLAMA_70B, STEP_OVERHEAD
from sim.route_plan.path_lp import PathBound
from sim.scenario import Scenario, run
from sim.swarm import SimNode
from sim.world import GATEWAY_LAST_MILE, SimGateway, World

EVERY = 30  # seconds between samples


def idle_round(world: World, gateway: SimGateway, hops: list[Hop]) -> tuple[float, float]:
    """(the chain's round on an idle swarm, its links), seconds per token, as ``dataplane`` prices them."""
    nodes = [world.nodes[h.peer_id] for h in hops]
    links = world.rtt_to(gateway.city, GATEWAY_LAST_MILE, nodes[0]) / 2
    links += sum(world.rtt_between(a, b) / 2 for a, b in zip(nodes, nodes[1:], strict=False))
    links += world.rtt_to(gateway.city, GATEWAY_LAST_MILE, nodes[-1]) / 2
    steps = sum(LEAST_WAIT * (STEP_OVERHEAD + n.span * n.hw.read_time) * n.slowdown for n in nodes)
    return links + steps + GATEWAY_WORK, links


def sample(world: World) -> list[float]:
    hops = partial = 0
    used = 0.0
    rounds, idle, links = [], [], []
    at_node = world.at_node if world.at_node is not None else np.zeros(len(world.node_list))
    for index, (nodes, blocks, hop_links) in world.decoding.items():
        session = world.sessions[index]
        for node, count in zip(nodes, blocks, strict=True):
            hops += 1
            partial += count < world.node_list[node].span
            used += session.request.max_length * count
        rounds.append(float(hop_links.sum() + GATEWAY_WORK + at_node[nodes].sum()))
        chain = idle_round(world, session.gateway, session.hops)
        idle.append(chain[0])
        links.append(chain[1])
    serving = world.serving()
    pool = sum(n.hw.cache_tokens * n.span for n in serving)
    charged = sum(n.reserved * n.span for n in serving)
    view = world.dht.view(world.clock.now)
    picks = []
    for gateway in world.gateways:  # a local RTT table: the gateways' own state is left alone
        rtts = {p: world.rtt_to(gateway.city, GATEWAY_LAST_MILE, world.nodes[p]) for p in view.servers}
        picks.append(idle_round(world, gateway, plan_route(view, RouteRequest(1, rtts=rtts, push=True), gateway.mode)))
    fastest = fastest_rounds(world, serving)
    sessions = max(1, len(world.decoding))
    served = used / sessions / world.model.num_blocks
    kept = world.bound_chains  # the run's own (its next bound starts there)
    at_served = path(world, served)
    world.bound_chains = kept
    return [
        len(world.decoding), hops / sessions, partial / max(1, hops), used / pool, charged / pool,
        float(np.mean(rounds)), float(np.mean(idle)), float(np.mean(links)),
        float(np.mean([p[0] for p in picks])), float(np.mean([p[1] for p in picks])), min(fastest),
        served, at_served.tokens_per_s if at_served is not None else float("nan"),
    ]  # fmt: skip


def oracle_next_rtts(worlds: list[World]) -> None:
    """Every ONLINE node's record carries the true RTT to every serving node of its end block."""
    announce = swarm.Dht.announce

    def announcing(self: swarm.Dht, node: SimNode, now: float) -> None:
        announce(self, node, now)
        if not worlds or node.state is not NodeState.ONLINE:
            return
        world = worlds[0]
        record, until = self.records[node.peer_id]
        after = {
            n.peer_id: world.rtt_between(node, n)
            for n in world.node_list
            if n.serving and n is not node and n.start <= node.end < n.end
        }
        self.records[node.peer_id] = (record.model_copy(update={"next_rtts": after}), until)

    swarm.Dht.announce = announcing  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--oracle-next-rtts", action="store_true")
    parser.add_argument("--planned-routing", action="store_true")
    parser.add_argument("--load", type=float, default=1.2)
    args = parser.parse_args()
    quick = Scenario("70b steady (quick)", model=LLAMA_70B, load=args.load).quick()  # quick() caps the nodes: set after
    chosen = replace(quick, nodes=args.nodes, seed=args.seed, planned_routing=args.planned_routing)
    samples: list[list[float]] = []
    worlds: list[World] = []
    began = time.process_time()
    populate, record = sim_scenario._populate, sim_scenario._record
    path_cpu = [0.0]  # CPU seconds in the path bound so far (a one-item list: the closure adds to it)

    def populating(scenario: Scenario) -> World:
        worlds.append(populate(scenario))
        return worlds[-1]

    def timed_path(world: World, held_length: float, seconds: float = 60.0) -> PathBound | None:
        began_call = time.process_time()
        found = path(world, held_length, seconds)
        spent = time.process_time() - began_call
        path_cpu[0] += spent
        text = "pricing gave up" if found is None else (
            f"{found.tokens_per_s:.0f} tok/s ({'closed' if found.closed else 'open'};"
            f" restricted LP {found.reached:.0f}, {found.iterations} iterations)"
        )  # fmt: skip
        print(f"  [path bound at {world.clock.now:.0f} s: {text}, {spent:.0f} CPU s]", file=sys.stderr, flush=True)  # noqa: T201
        return found

    def recording(world: World, t: float, throughput: float, latest: tuple[float, float]) -> None:
        record(world, t, throughput, latest)
        if t >= chosen.measure_from and int(t) % EVERY == 0 and world.decoding:
            samples.append(sample(world))
        if int(t) % EVERY == 0:  # a 300-node run takes an hour of CPU: say how far it is, and where the CPU went
            done = f"{t:.0f} of {chosen.duration:.0f} virtual s, {time.process_time() - began:.0f} CPU s"
            split = f"plan_route {sum(world.route_times):.0f} s, path bound {path_cpu[0]:.0f} s"
            split += f", gateways' plans {sum(world.plan_times):.0f} s" if world.plan_times else ""
            print(f"  [{done} ({split}), ours {throughput:.0f} tok/s]", file=sys.stderr, flush=True)  # noqa: T201

    sim_scenario._populate, sim_scenario._record = populating, recording
    sim_scenario.path = timed_path  # type: ignore[attr-defined]  # scenario's own name for ``dataflow.path``
    if args.oracle_next_rtts:
        oracle_next_rtts(worlds)
    s = run(chosen).summary
    a = np.array(samples).mean(axis=0)
    print(  # noqa: T201
        f"nodes {chosen.nodes} seed {chosen.seed} load {chosen.load}"
        f"{' oracle next_rtts' if args.oracle_next_rtts else ''}"
        f"{' planned routing' if args.planned_routing else ''}:"
        f" ours {s['throughput']:.0f} tok/s, path bound {s['bound']:.0f}, ours/bound {s['ratio']:.3f}"
        f" (per-node bound {s['node_bound']:.0f}, ours/per-node {s['node_ratio']:.3f};"
        f" per-node in {s['path_kept_node']:.0f} samples where pricing gave up, gap open in {s['path_open']:.0f}),"
        f" finished {s['finished']:.0f}, refused {s['refused']:.0f}\n"
        f"  decoding {a[0]:.0f}, hops/session {a[1]:.2f}, hops over part of a span {a[2]:.3f},"
        f" KV memory used {a[3]:.3f}, charged by the pools {a[4]:.3f}\n"
        f"  session round {a[5]:.3f} s, its chain idle {a[6]:.3f} s (links {a[7]:.3f} s);"
        f" served mean max_length {a[11]:.0f}"
        f" (path bound with it as H: {a[12]:.0f}, ours/that {s['throughput'] / a[12]:.3f});"
        f" plan_route with room ignored: idle {a[8]:.3f} s (links {a[9]:.3f} s); fastest chain {a[10]:.3f} s;"
        f" CPU {time.process_time() - began:.0f} s"
    )


if __name__ == "__main__":
    main()
