"""A volunteer behind a home router: the node finds out nobody can dial it, takes a relay, and serves through it.

Built with network namespaces (tests/helpers/netns.py): the bootstrap, a public node and the gateway on this machine's
side of a veth link, the volunteer's node behind a masquerading router. Needs root, ip and iptables (CI runs as root).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import netns
from tests.helpers.gateway import Gateway, kill_tree, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm
from tests.tiny_models import GetTinyModel

why_not = netns.available()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(why_not is not None, reason=f"home NAT: {why_not}"),
]

PROMPT = [5, 17, 99, 3, 42, 8, 1]


@pytest.fixture
def nat() -> Iterator[netns.HomeNat]:
    with netns.home_nat() as built:
        yield built


@pytest.fixture
def swarm(local_swarm: LocalSwarm) -> Iterator[LocalSwarm]:
    yield local_swarm
    stop_gracefully(local_swarm)


def public(nat: netns.HomeNat) -> tuple[str, str]:
    return ("--host-maddrs", f"/ip4/{nat.public_ip}/tcp/0")


def at_home(nat: netns.HomeNat) -> tuple[str, str]:
    return ("--host-maddrs", f"/ip4/{nat.home_ip}/tcp/0")


def node_report(gateway: Gateway, peer_id: str, http: httpx.Client) -> dict[str, object]:
    nodes = http.get("/v1/swarm").json()["nodes"]
    return next(node for node in nodes if node["peer_id"] == peer_id)


def wait_for(condition: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.3)
    raise TimeoutError(what)


def greedy(http: httpx.Client, max_tokens: int) -> list[int]:
    # The tiny model's word-level tokenizer spells token i as "ti", joined by spaces.
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return [int(word[1:]) for word in reply.json()["choices"][0]["text"].split()]


def test_a_node_behind_nat_serves_through_a_relay_and_fails_over_like_any_node(
    nat: netns.HomeNat, swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("llama")
    expected = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False)[0, 7:].tolist()
    swarm.start_dht(host=nat.public_ip)
    first = swarm.start_node(tiny.folder, "0:3", *public(nat))
    # The plain command: no flag about NAT or relays (but --relay-wait: the node reserves its relay slot itself, at
    # once; p2pd's autorelay alone takes about 3 minutes, after which this node would announce itself unreachable).
    # --added-latency keeps a long stream running while we kill it.
    home_flags = ("--relay-wait", "60", "--added-latency", "0.05")
    home = swarm.start_node(tiny.folder, "3:6", *at_home(nat), *home_flags, wrapper=nat.wrapper)
    swarm.wait_serving(first)
    home_peer = swarm.wait_serving(home)
    assert "reserved a relay slot on" in home.log_text(), home.log_text()[-3000:]
    assert "reachable through relay" in home.log_text(), home.log_text()[-3000:]

    gateway = start_gateway(swarm, tiny.folder, *public(nat), "--served-model-name", "m")
    with gateway.http() as http:
        report = node_report(gateway, home_peer, http)
        assert report["reachability"] == "relayed" and report["relay_addrs"], report
        assert node_report(gateway, first.peer_id, http)["reachability"] == "direct"
        assert greedy(http, 24) == expected  # every step crossed the NAT through the relay

        # Killed mid-stream, the relayed node fails over to a replacement like any node. The replacement answers
        # slower, so routing (min_latency) keeps choosing the relayed node until it dies.
        replacement = swarm.start_node(tiny.folder, "3:6", *public(nat), "--added-latency", "0.3")
        swarm.wait_serving(replacement)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True}
        words: list[str] = []
        with http.stream("POST", "/v1/completions", json=body) as stream:
            for line in stream.iter_lines():
                if line == "data: [DONE]":
                    break
                if not line.startswith("data: "):
                    continue
                if len(words) == 3:
                    kill_tree(home)
                words += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"].split()
        assert [int(word[1:]) for word in words] == expected
        assert http.get("/v1/swarm").json()["counters"]["failovers"] >= 1  # the stream did go through the NAT


def test_with_relaying_off_a_node_behind_nat_is_reported_unreachable_and_not_coverage(
    nat: netns.HomeNat, swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("llama")
    swarm.start_dht("--no-relay-hop", host=nat.public_ip)
    first = swarm.start_node(tiny.folder, "0:3", *public(nat), "--no-relay-hop")
    home = swarm.start_node(tiny.folder, "3:6", *at_home(nat), "--no-use-relay", wrapper=nat.wrapper)
    swarm.wait_serving(first)
    home_peer = swarm.wait_serving(home)
    assert "NOT reachable" in home.log_text(), home.log_text()[-3000:]

    gateway = start_gateway(swarm, tiny.folder, *public(nat), "--served-model-name", "m", wait_ready=False)
    with gateway.http() as http:
        wait_for(lambda: any(n["peer_id"] == home_peer for n in http.get("/v1/swarm").json()["nodes"]), "home record")
        swarm_json = http.get("/v1/swarm").json()
        assert node_report(gateway, home_peer, http)["reachability"] == "unreachable"
        assert swarm_json["missing_blocks"] == [3, 4, 5]  # its record is not coverage
        reply = http.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4})
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "missing_blocks" and "3:6" in error["message"]
        assert home_peer not in error["message"]


REPO = Path(__file__).parents[2]  # the scripts import tests.helpers

# Run in a fresh interpreter inside the home namespace (hivemind forks the DHT child; a fork of a pytest worker can
# deadlock). Only the relay client's DHT is killed: reachability_probe starts it, the node's first DHT is server's.
RELAY_CLIENT_DIES = """
import asyncio, sys
from shared.errors import DhtLost
from swarm_node import reachability_probe
from swarm_node.server import SpanServer
from swarm_node.settings import NodeSettings
from tests.helpers.dht_kill import killed_as_started

kill_as_started = killed_as_started(reachability_probe.start_dht)

def start_and_kill(**kwargs):  # the relay client's DHT dead as it is handed over
    dht = kill_as_started(**kwargs)
    print("killed the relay client's DHT", flush=True)
    return dht

reachability_probe.start_dht = start_and_kill
model, host, peers = sys.argv[1], sys.argv[2], sys.argv[3:]
settings = NodeSettings(
    model=model, blocks="3:6", initial_peers=peers, device="cpu", host_maddrs=[f"/ip4/{host}/tcp/0"], relay_wait=60
)
try:
    asyncio.run(SpanServer(settings).run(asyncio.Event()))
except DhtLost as lost:
    print(f"DhtLost: {lost}")
    sys.exit(3)
"""


def test_a_node_whose_relay_client_dht_dies_as_it_starts_stops_with_an_error(
    nat: netns.HomeNat, swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    """Nobody can dial the node, so it swaps its DHT for a relay client's; that one dead at once: ``DhtLost`` and
    exit, not a wait forever (the watch was on the DHT it had stopped, the new one unwatched until its span loaded)."""
    tiny = tiny_with_tokenizer("llama")
    swarm.start_dht(host=nat.public_ip)
    args = [*nat.wrapper, sys.executable, "-c", RELAY_CLIENT_DIES, str(tiny.folder), nat.home_ip, *swarm.initial_peers]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the node was still starting 120 s after its relay client's DHT died:\n{hung.stderr!r}"[-3000:])
    assert "killed the relay client's DHT" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert "DhtLost: the DHT process" in done.stdout
