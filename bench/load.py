"""Sustained load on a local SmolLM2 swarm with locust (headless), optionally with nodes joining and leaving.

Starts a private redis-server, a DHT, two nodes (0:15, 15:30) and `gateway serve` on 127.0.0.1, then runs locust
(bench/locustfile.py: users streaming greedy chat completions) for ``--duration`` seconds and prints one table like
`vllm bench serve`'s: requests, failures, deliberate 429s, and p50/p99 of time to first token, inter-token latency
and end-to-end latency. With ``--churn`` an extra replica of one span joins, and after ``--churn-period`` seconds
leaves (SIGTERM, short drain), alternating spans, for the whole run. The table is also written to ``--out``.

    .venv/bin/python -m bench.load --users 100 --duration 60
    .venv/bin/python -m bench.load --users 100 --duration 60 --churn
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.capacity import SPANS, LocalSwarm, Node, smollm2_path

LISTENING = re.compile(r"serving (\S+) on (http://127\.0\.0\.1:\d+)/v1")
ROWS = ("chat stream", "time to first token", "inter-token latency", "end-to-end", "429 (backpressure)")


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    executable = shutil.which("redis-server")
    if executable is None:
        raise SystemExit("redis-server is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [executable, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    process = subprocess.Popen([*args, "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(0.5)
    return process, f"redis://127.0.0.1:{port}/0"


def start_gateway(swarm: LocalSwarm, model: Path, redis_url: str, extra: list[str]) -> tuple[Node, str, str]:
    log = swarm.workdir / "gateway.log"
    args = [sys.executable, "-m", "gateway.cli", "serve", str(model), "--port", "0", "--num-threads", "1"]
    args += ["--redis-url", redis_url, "--initial-peers", *swarm.initial_peers, *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=swarm.env)
    swarm.processes.append(process)
    deadline = time.monotonic() + 300
    while not (match := LISTENING.search(log.read_text(errors="replace"))):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the gateway did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    model_id, url = match.group(1), match.group(2)
    with httpx.Client(base_url=url, trust_env=False) as client:
        while client.get("/ready", params={"swarm": "complete"}).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit("the gateway never became ready")
            time.sleep(0.3)
    return Node(process, log), model_id, url


class Churn(threading.Thread):
    """An extra replica joins (alternating spans), serves for ``period`` seconds, then leaves with a short drain."""

    def __init__(self, swarm: LocalSwarm, model: Path, period: float) -> None:
        super().__init__(daemon=True)
        self.swarm, self.model, self.period = swarm, model, period
        self.stopping = threading.Event()
        self.joins = self.leaves = 0

    def run(self) -> None:
        turn = 0
        while not self.stopping.is_set():
            node = self.swarm.start_node(self.model, SPANS[turn % 2], "none", ["--drain-timeout", "3"])
            self.swarm.wait_serving(node)
            self.joins += 1
            self.stopping.wait(self.period)
            node.process.send_signal(signal.SIGTERM)
            node.process.wait(60)
            self.leaves += 1
            turn += 1


def locust_stats(prefix: Path) -> dict[str, dict[str, str]]:
    with Path(f"{prefix}_stats.csv").open() as stats:
        return {row["Name"]: row for row in csv.DictReader(stats)}


def table(stats: dict[str, dict[str, str]], args: argparse.Namespace, churn: Churn | None, load: str) -> str:
    lines = [
        "| entry | count | failures | p50 ms | p99 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in ROWS:
        row = stats.get(name)
        if row is None:
            continue
        p50, p99 = ("—", "—") if name.startswith("429") else (row["50%"], row["99%"])
        lines.append(f"| {name} | {row['Request Count']} | {row['Failure Count']} | {p50} | {p99} |")
    churned = f", churn: {churn.joins} joins / {churn.leaves} leaves" if churn else ""
    lines.append("")
    lines.append(
        f"{args.users} locust users, {args.duration} s, {args.max_tokens} max tokens per greedy chat stream,"
        f" gateway cap {args.max_concurrent} concurrent generations{churned}; 2 CPUs, load average {load}."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--spawn-rate", type=float, default=20.0)
    parser.add_argument("--duration", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-concurrent", type=int, default=32, help="the gateway's --max-concurrent-generations")
    parser.add_argument("--churn", action="store_true", help="an extra replica joins and leaves all along")
    parser.add_argument("--churn-period", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    model = smollm2_path()
    with tempfile.TemporaryDirectory(prefix="swarmgate-load-") as tmp:
        workdir = Path(tmp)
        redis, redis_url = start_redis(workdir)
        swarm = LocalSwarm(workdir, threads=1)
        churn = None
        try:
            swarm.start_dht()
            nodes = [swarm.start_node(model, blocks, "none", []) for blocks in SPANS]
            for node in nodes:
                swarm.wait_serving(node)
            _, model_id, url = start_gateway(
                swarm, model, redis_url, ["--max-concurrent-generations", str(args.max_concurrent)]
            )
            if args.churn:
                churn = Churn(swarm, model, args.churn_period)
                churn.start()
            prefix = workdir / "locust"
            env = {**os.environ, "SWARMGATE_MODEL": model_id, "SWARMGATE_MAX_TOKENS": str(args.max_tokens)}
            command = [sys.executable, "-m", "locust", "-f", str(Path(__file__).with_name("locustfile.py"))]
            command += ["--headless", "--host", url, "--users", str(args.users), "--spawn-rate", str(args.spawn_rate)]
            command += [
                "--run-time",
                f"{args.duration}s",
                "--csv",
                str(prefix),
                "--only-summary",
                "--stop-timeout",
                "120",
            ]
            subprocess.run(command, env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            load = f"{os.getloadavg()[0]:.1f}"
            if churn is not None:
                churn.stopping.set()
                churn.join(120)
            result = table(locust_stats(prefix), args, churn, load)
        finally:
            swarm.close()
            redis.kill()
            redis.wait()
            for log in workdir.glob("*.log"):  # kept for a look after the run
                shutil.copy(log, Path(tempfile.gettempdir()) / f"swarmgate-load-{log.name}")
    print(result)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "load-churn.md" if args.churn else "load.md"
    (args.out / name).write_text(result + "\n")
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
