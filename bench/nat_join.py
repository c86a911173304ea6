"""How soon a volunteer's node behind a home NAT serves its first request, from the moment it is started.

    .venv/bin/python -m bench.nat_join [--runs 3]        (root: network namespaces and iptables, as CI has)

The home NAT of tests/helpers/netns.py (a masquerading router namespace that forwards only replies inward); a
bootstrap DHT, a public node (blocks 0:3 of the tiny llama) and a gateway on this machine's side; then, per run, the
home node (blocks 3:6, the only one serving them) is started inside the home namespace with the plain command, and a
greedy completion is sent every half second until one answers 200. Printed per run: seconds from the node's start to
its reachability verdict, to its "serving" line, and to the first answered request; the home node is then killed
(its whole process tree) and started again for the next run: a join and each restart cost the same.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers import netns
from tests.helpers.gateway import kill_tree, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm, ManagedProcess, save_tiny_tokenizer
from tests.tiny_models import VOCAB, build_tiny

VERDICT = re.compile(r"reachable through relay|reachable directly: |NOT reachable")
BODY = {"model": "m", "prompt": [5, 17, 99, 3], "max_tokens": 4, "temperature": 0}
GIVE_UP = 420.0  # seconds: p2pd's autorelay alone takes about 3 minutes


@dataclass(frozen=True)
class Join:
    verdict: float  # seconds from the start to the reachability verdict in its log
    serving: float  # ... to its "serving blocks" line
    first_request: float  # ... to the first completion answered 200
    how: str  # the verdict's words


def run_once(swarm: LocalSwarm, nat: netns.HomeNat, model: Path, http: httpx.Client) -> Join:
    started = time.monotonic()
    home = swarm.start_node(model, "3:6", "--host-maddrs", f"/ip4/{nat.home_ip}/tcp/0", wrapper=nat.wrapper)
    verdict = serving = None
    try:
        while time.monotonic() - started < GIVE_UP:
            log = home.log_text()
            if verdict is None and (found := VERDICT.search(log)):
                verdict, how = time.monotonic() - started, found.group(0)
            if serving is None and "serving blocks" in log:
                serving = time.monotonic() - started
            if serving is not None and _answers(http):
                assert verdict is not None  # logged before "serving"
                return Join(verdict, serving, time.monotonic() - started, how)
            if home.popen.poll() is not None:
                raise RuntimeError(f"the home node exited:\n{log[-3000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"no request served {GIVE_UP:.0f}s after the home node started:\n{home.log_text()[-3000:]}")
    finally:
        _kill(swarm, home)


def _answers(http: httpx.Client) -> bool:
    try:
        return http.post("/v1/completions", json=BODY, timeout=20).status_code == 200
    except httpx.TransportError:
        return False


def _kill(swarm: LocalSwarm, node: ManagedProcess) -> None:
    kill_tree(node)
    swarm.processes.remove(node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--logs", type=Path, help="keep the processes' logs in this folder (default: a temporary one)")
    args = parser.parse_args()
    why_not = netns.available()
    if why_not is not None:
        sys.exit(f"cannot build the home NAT here: {why_not}")
    with tempfile.TemporaryDirectory(prefix="nat-join-") as temporary, netns.home_nat() as nat:
        work = args.logs or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        model = work / "tiny"
        build_tiny("llama").save_pretrained(model)
        save_tiny_tokenizer(model, VOCAB)
        swarm = LocalSwarm(work)
        public = ("--host-maddrs", f"/ip4/{nat.public_ip}/tcp/0")
        try:
            swarm.start_dht(host=nat.public_ip)
            swarm.wait_serving(swarm.start_node(model, "0:3", *public))
            gateway = start_gateway(swarm, model, *public, "--served-model-name", "m", wait_ready=False)
            with gateway.http() as http:
                joins = [run_once(swarm, nat, model, http) for _ in range(args.runs)]
        finally:
            stop_gracefully(swarm)
            swarm.close()
    print("| run | verdict s | serving s | first request s | verdict |")
    print("| --- | --- | --- | --- | --- |")
    for index, join in enumerate(joins, 1):
        print(f"| {index} | {join.verdict:.1f} | {join.serving:.1f} | {join.first_request:.1f} | {join.how} |")
    print(f"median first request: {statistics.median(j.first_request for j in joins):.1f} s after start")


if __name__ == "__main__":
    main()
