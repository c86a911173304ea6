"""Single-stream decode with the gateway's checks off and on (`make bench-verify`, second part).

SmolLM2 on two local nodes that both serve every block (so spot checks have another replica to run on), one
gateway with ``--no-verify`` and one with the defaults (probation, spot checks at ``--verify-check-rate`` 0.02),
alternating runs of one greedy streamed completion each; prints the median decode tokens/s of each and their ratio.
Checks run off the token path, so the ratio should be about 1: what they cost is the checker's compute (the nodes'
CPU, shared here with everything else on the machine). Both gateways decode without speculation: on loopback the
chain's round trip (5-12 ms, probed) sits around ``--speculative-min-rtt`` (10 ms), so whether a gateway drafts at
all flips with its probes — a 3.5x difference in tokens/s that has nothing to do with the checks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import httpx

from bench.http_latency import PROMPT, model_id, one_run
from bench.verify_spans import smollm2_folder
from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm


def measure(gateways: dict[str, Gateway], tokens: int, runs: int) -> dict[str, list[float]]:
    speeds: dict[str, list[float]] = {name: [] for name in gateways}
    clients = {name: httpx.Client(base_url=g.url, trust_env=False, timeout=600) for name, g in gateways.items()}
    try:
        models = {name: model_id(client) for name, client in clients.items()}
        for name, client in clients.items():
            one_run(client, models[name], PROMPT, 8)  # warm-up
        for _ in range(runs):
            for name, client in clients.items():  # alternating: drift on the machine hits both alike
                speeds[name].append(one_run(client, models[name], PROMPT, tokens).decode_tps)
    finally:
        for client in clients.values():
            client.close()
    return speeds


def main(argv: list[str] | None = None) -> str:
    """``argv``: this module's flags (``bench.verify`` passes none: the defaults)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv if argv is not None else [])
    gguf = smollm2_folder()
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as folder:
        swarm = LocalSwarm(Path(folder))
        try:
            swarm.start_dht()
            nodes = [swarm.start_node(gguf, "0:30", name=f"node-{i}") for i in range(2)]
            for node in nodes:
                swarm.wait_serving(node)
            plain = ("--speculative", "off")  # see the docstring
            gateways = {
                "off": start_gateway(swarm, gguf, "--no-verify", *plain),
                "on": start_gateway(swarm, gguf, *plain),
            }
            speeds = measure(gateways, args.tokens, args.runs)
        finally:
            stop_gracefully(swarm)
    off, on = (statistics.median(speeds[k]) for k in ("off", "on"))
    return (
        f"Single-stream decode without speculation, SmolLM2 through one of two full-span local nodes, {args.tokens}"
        f" tokens, median of"
        f" {args.runs}: checks off {off:.1f} tokens/s, on {on:.1f} tokens/s (**{100 * (on / off - 1):+.1f} %**)."
    )


if __name__ == "__main__":
    import sys

    print(main(sys.argv[1:]))
