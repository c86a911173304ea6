"""The report of a run: a markdown table (``bench/results/sim.md``) and plots (``bench/results/sim-*.png``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sim.dht_traffic import per_node, record_bytes  # noqa: E402
from sim.scenario import Result  # noqa: E402


def write(
    results: Sequence[Result], route_times: dict[int, tuple[list[float], list[float]]], folder: Path, command: str
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"# Simulated swarm (`{command}`)", "", *_legend(), "", *_table(results), "", *_routes(route_times), ""]
    lines += _dht(results)
    for result in results:
        _plot(result, folder)
    path = folder / "sim.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _legend() -> list[str]:
    return [
        "Means over each scenario's steady window (before its event). *bound*: the path LP over the hardware and"
        " placement (tokens/s per chain at its idle round, compute and KV room per node; `route_plan/path_lp.py`,"
        " sim/ASSUMPTIONS.md), or the per-node bound in the samples marked where its pricing gave up; *per-node"
        " bound*: the LP max-flow with each node's KV pool at the fastest chain through it (the bound before; it"
        " sizes the arrivals; after an event, its figures are in brackets); *after event*: against the path bound up to"
        " 2 balance periods + 15 s on, the per-node one past that, and ours' mean tokens/s from the event to the end"
        " (the bounds are steady-state figures, and fall while nodes move); *offered*: what the arrivals ask for;"
        " *served*: ours / min(offered, bound), what could be served at best."
    ]


def _table(results: Sequence[Result]) -> list[str]:
    rows = [
        "| scenario | nodes | ours tok/s | bound tok/s | ours/bound | per-node bound | ours/per-node | offered tok/s"
        " | served | compute bound | after event | finished | refused | lost | failovers | moves | TTFT p50 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = {"node_bound": r.summary["bound"], "node_ratio": r.summary["ratio"]} | r.summary  # older saved runs
        rows.append(
            f"| {r.scenario.name} | {r.scenario.nodes} | {s['throughput']:.0f} | {s['bound']:.0f}{_kept(s)}"
            f" | {s['ratio']:.1%} | {s['node_bound']:.0f} | {s['node_ratio']:.1%} | {s['offered']:.0f}"
            f" | {s['served']:.1%} | {s['compute_bound']:.0f} | {_after(s)}"
            f" | {s['finished']:.0f} | {s['refused']:.0f} | {s['lost']:.0f} | {s['failovers']:.0f} | {s['moves']:.0f}"
            f" | {s['ttft_p50']:.1f} |"
        )
    return rows


def _kept(summary: dict[str, float]) -> str:
    kept = int(summary.get("path_kept_node", 0))
    return f" (per-node in {kept} samples)" if kept else ""


def _after(summary: dict[str, float]) -> str:
    """Against the path bound, the per-node one in brackets (saved runs from before have the latter only)."""
    if "recovered_after" in summary:
        text = _recovered(summary, "")
        text += f" (per-node: {_recovered(summary, 'node_')})" if "node_recovered_after" in summary else ""
        after = summary.get("throughput_after")
        return text + (f"; ours after: {after:.0f} tok/s" if after is not None else "")
    if "flash_ratio" in summary:
        node = f" (per-node: {summary['node_flash_ratio']:.0%})" if "node_flash_ratio" in summary else ""
        return f"during: {summary['flash_ratio']:.0%}{node}"
    return "-"


def _recovered(summary: dict[str, float], prefix: str) -> str:
    back = summary[f"{prefix}recovered_after"]
    when = "never" if math.isinf(back) else f"{back:.0f} s"
    return f"back >80 %: {when}; at 2 periods {summary[f'{prefix}ratio_at_two_periods']:.0%}"


def _routes(route_times: dict[int, tuple[list[float], list[float]]]) -> list[str]:
    rows = ["## Route choice by swarm size", "",
            "The real `plan_route` (push, min_latency: the gateway's defaults) on a settled 405B-shaped swarm, from"
            " each gateway in turn; CPU seconds of the calling process (the machine is shared). *With next hops*:"
            " every record carries the round trips swarm_node measures and announces (4 servers of its end block).",
            "", "| nodes | calls | p50 ms | p99 ms | with next hops: p50 ms | p99 ms |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for nodes, (plain, linked) in sorted(route_times.items()):
        a, b = np.array(plain) * 1e3, np.array(linked) * 1e3
        rows.append(
            f"| {nodes} | {len(a)} | {np.median(a):.2f} | {np.percentile(a, 99):.2f} | {np.median(b):.2f}"
            f" | {np.percentile(b, 99):.2f} |"
        )
    return rows


def _dht(results: Sequence[Result]) -> list[str]:
    rows = [f"## DHT traffic per node (record: {record_bytes()} bytes packed)", "",
            "| nodes | mean span | announce MB/min | reads MB/min | stored for others MB/min | total Mbit/s |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for nodes in (100, 300, 1000):
        spans = [span for r in results if r.scenario.nodes == nodes for span in r.spans]
        span = float(np.mean(spans)) if spans else 8.0
        t = per_node(nodes, 126, span)
        rows.append(
            f"| {nodes} | {span:.1f} | {t.announce / 1e6:.2f} | {t.reads / 1e6:.2f} | {t.stored_for_others / 1e6:.2f}"
            f" | {t.total * 8 / 60 / 1e6:.2f} |"
        )
    return rows


def _plot(result: Result, folder: Path) -> None:
    m = result.metrics
    fig, axis = plt.subplots(figsize=(8, 3.5))
    axis.plot(m.times, m.throughput, label="ours (decoded tokens/s)")
    axis.plot(m.times, m.bound, label="per-node bound")
    axis.plot(m.times, m.path_bound, label="path bound (steady window)")
    if result.scenario.event:
        axis.axvline(result.scenario.event_at, color="grey", linestyle="--", label=result.scenario.event)
    axis.set_xlabel("virtual seconds")
    axis.set_ylabel("tokens/s")
    axis.set_title(f"{result.scenario.name}, {result.scenario.nodes} nodes")
    axis.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(folder / f"sim-{_slug(result.scenario.name)}-{result.scenario.nodes}.png", dpi=90)
    plt.close(fig)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
