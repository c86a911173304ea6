"""Where our routing and the path LP's optimum part ways, on one loaded world: the quick 70B steady scenario
(``sim/scenarios.py``, 1.2x) run to its first path bound in the steady window (330 virtual s), then the decoding
sessions' chains set beside the optimum's. Not a test: it prints a few lines and reads the world without changing it.

``python -m bench.sim_optimum [--nodes N] [--seed S]``. Printed, ours then the optimum's (its sessions are y_c x T_c
on chain c, each holding the bound's H): sessions, tokens/s, a session's round (mean and session-weighted
quantiles), hops and hops entered mid-span a session; the share of each GPU class's KV memory in use; the nodes the
optimum's fastest chains (round under ``FAST``) run through, with the rounds of our sessions on the same nodes; and
sessions by gateway. The question it answers: are our sessions slower because their nodes are slower, or because
fast and slow nodes share chains (bench/README.md, stop 52)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from dataclasses import replace

import numpy as np

import sim.scenario as sim_scenario
from sim.dataflow import path
from sim.dataplane import GATEWAY_WORK
from sim.hardware import LLAMA_70B
from sim.route_plan.path_lp import PathBound
from sim.scenario import Scenario, run
from sim.world import World

FAST = 0.3  # seconds per token: the optimum's chains under this are "fast" (its quickest quarter at 100 nodes)
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
SHOWN = 12  # fast-chain nodes printed


class _Compared(Exception):
    """Raised from the bound's call once the comparison is printed: the run need not go on."""


def compare(world: World, found: PathBound, held_length: float) -> None:
    rounds, hops, mid, kv_ours = [], [], [], defaultdict[str, float](float)
    at_node = world.at_node if world.at_node is not None else np.zeros(len(world.node_list))  # as sim_chains
    on_node: defaultdict[str, list[float]] = defaultdict(list)
    for index, (nodes, blocks, links) in world.decoding.items():
        length = world.sessions[index].request.max_length
        round_ = float(links.sum() + GATEWAY_WORK + at_node[nodes].sum())
        rounds.append(round_)
        hops.append(len(nodes))
        mid.append(sum(int(count < world.node_list[n].span) for n, count in zip(nodes, blocks, strict=True)))
        for n, count in zip(nodes, blocks, strict=True):
            node = world.node_list[n]
            kv_ours[node.hw.gpu.name] += length * count
            on_node[node.peer_id].append(round_)
    ours = np.array(rounds)
    print(  # noqa: T201
        f"ours:    {len(ours)} sessions, {np.sum(1 / ours):.0f} tok/s, round {ours.mean():.3f} s"
        f" (quantiles {[round(float(q), 3) for q in np.quantile(ours, QUANTILES)]}),"
        f" {np.mean(hops):.2f} hops, {np.mean(mid):.2f} entered mid-span"
    )
    chains, kv_optimum = world.bound_chains, defaultdict[str, float](float)  # ``path`` left the optimum's chains there
    sessions = np.array([c.sessions for c in chains])
    optimum = np.array([c.sessions / y for c, y in zip(chains, found.rates, strict=True)])
    for chain in chains:
        for hop in chain.hops:
            kv_optimum[world.nodes[hop.peer_id].hw.gpu.name] += held_length * (hop.end - hop.start) * chain.sessions
    by_session = np.quantile(optimum, QUANTILES, weights=sessions, method="inverted_cdf")  # session-weighted
    mid_optimum = [sum(int(h.start > world.nodes[h.peer_id].start) for h in c.hops) for c in chains]
    print(  # noqa: T201
        f"optimum: {sessions.sum():.0f} sessions, {found.reached:.0f} tok/s, round"
        f" {np.average(optimum, weights=sessions):.3f} s"
        f" (quantiles {[round(float(q), 3) for q in by_session]}),"
        f" {np.average([len(c.hops) for c in chains], weights=sessions):.2f} hops,"
        f" {np.average(mid_optimum, weights=sessions):.2f} entered mid-span; {len(chains)} chains,"
        f" bound {found.tokens_per_s:.0f} ({'closed' if found.closed else 'open'})"
    )
    pool = defaultdict[str, float](float)
    for node in world.carrying():
        pool[node.hw.gpu.name] += node.hw.cache_tokens * node.span
    shares = ", ".join(f"{g} {kv_ours[g] / pool[g]:.2f} / {kv_optimum[g] / pool[g]:.2f}" for g in sorted(pool))
    print(f"KV memory in use by GPU class, ours / optimum: {shares}")  # noqa: T201
    fast = defaultdict[str, float](float)
    for chain, round_ in zip(chains, optimum, strict=True):
        if round_ < FAST:
            for hop in chain.hops:
                fast[hop.peer_id] += chain.sessions
    print(f"nodes of the optimum's chains under {FAST} s (its sessions there; ours: count, round p10/p50/p90):")  # noqa: T201
    for peer, count in sorted(fast.items(), key=lambda item: -item[1])[:SHOWN]:
        node, here = world.nodes[peer], np.array(on_node.get(peer, [np.nan]))
        print(  # noqa: T201
            f"  {peer} {node.hw.gpu.name} {node.city.name} blocks {node.start}-{node.end}: optimum {count:.0f},"
            f" ours {len(on_node.get(peer, []))} at {np.nanquantile(here, 0.1):.3f} / {np.nanmedian(here):.3f} /"
            f" {np.nanquantile(here, 0.9):.3f} s"
        )
    by_gateway = defaultdict[int, float](float)
    for chain in chains:
        by_gateway[chain.gateway] += chain.sessions
    ours_by_gateway = Counter(world.gateways.index(world.sessions[i].gateway) for i in world.decoding)
    print(  # noqa: T201
        "sessions by gateway, ours / optimum: "
        + ", ".join(f"{g.city.name} {ours_by_gateway[i]} / {by_gateway[i]:.0f}" for i, g in enumerate(world.gateways))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    quick = Scenario("70b steady (quick)", model=LLAMA_70B, load=1.2).quick()  # quick() caps the nodes: set after
    chosen = replace(quick, nodes=args.nodes, seed=args.seed)

    def comparing(world: World, held_length: float, seconds: float = 60.0) -> PathBound | None:
        found = path(world, held_length, seconds)
        if found is None or world.clock.now < chosen.measure_from:
            return found
        print(f"at {world.clock.now:.0f} virtual s, {args.nodes} nodes, seed {args.seed}:")  # noqa: T201
        compare(world, found, held_length)
        raise _Compared

    sim_scenario.path = comparing  # type: ignore[attr-defined]  # scenario's own name for ``dataflow.path``
    try:
        run(chosen)
    except _Compared:
        return
    print("the run ended before a path bound in the steady window", file=sys.stderr)  # noqa: T201


if __name__ == "__main__":
    main()
