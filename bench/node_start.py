"""One node's start, phase by phase: SmolLM2 blocks 0:4 from the bundled GGUF, joined to a local DHT bootstrap.

    .venv/bin/python -m bench.node_start [--runs 3] [--warm-config]

Per run: seconds from the start to each line the node logs (the first one comes after the imports and the DHT
join), to its "serving" line, and the CPU seconds its process (and the whole tree: DHT child, p2pd) had used by
then — CPU time moves less than wall time on a machine other jobs share. ``--warm-config``: the node finds its
GGUF config already converted in the config cache (a restart); without it the cache is empty (a machine's first
start). To compare two checkouts, run the script file of this one with the other's tree first on PYTHONPATH (the
node is started with this interpreter and that environment; the GGUF and the log's time stamps come from that tree's
``bench.swarm24``, which has both since 416f1b4).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

from bench.swarm24 import STAMP, smollm2
from tests.helpers.processes import LocalSwarm


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def one_start(gguf: Path, work: Path) -> tuple[float, float, float]:
    """(seconds to serving, CPU seconds of the node's main process, of its whole tree); prints its log's lines."""
    swarm = LocalSwarm(work)
    try:
        swarm.start_dht()
        began = time.time()
        node = swarm.start_node(gguf, "0:4")
        swarm.wait_serving(node, timeout=600)
        serving = time.time() - began
        main = psutil.Process(node.popen.pid)
        tree = cpu_seconds(main) + sum(cpu_seconds(child) for child in main.children(recursive=True))
        for stamp, text in STAMP.findall(node.log_text()):
            at = datetime.strptime(f"{datetime.now().year} {stamp}", "%Y %b %d %H:%M:%S.%f").timestamp()
            print(f"  {at - began:6.2f} s  {text[:110]}")
        return serving, cpu_seconds(main), tree
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warm-config", action="store_true", help="convert the GGUF config once before the runs")
    args = parser.parse_args()
    gguf = smollm2()
    results = []
    with tempfile.TemporaryDirectory(prefix="node-start-") as temporary:
        configs = Path(temporary) / "configs"
        if args.warm_config:
            from shared.model_source import load_config, resolve_model

            load_config(resolve_model(str(gguf)), configs)
        for run in range(1, args.runs + 1):
            work = Path(temporary) / f"run{run}"
            work.mkdir()
            if args.warm_config:
                (work / "configs").symlink_to(configs)  # LocalSwarm points SWARMGATE_CONFIG_CACHE here
            print(f"run {run}:")
            serving, main_cpu, tree_cpu = one_start(gguf, work)
            print(f"run {run}: serving after {serving:.1f} s, CPU {main_cpu:.1f} s (tree {tree_cpu:.1f} s)")
            results.append((serving, main_cpu, tree_cpu))
    serving, main_cpu, tree_cpu = (statistics.median(column) for column in zip(*results, strict=True))
    print(f"median of {len(results)}: serving after {serving:.1f} s, CPU {main_cpu:.1f} s (tree {tree_cpu:.1f} s)")


if __name__ == "__main__":
    main()
