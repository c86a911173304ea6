"""Every swarm process exits within its drain time + 10 s of SIGTERM, whoever else is gone (issue 27, part 6).

Each kind — a node, a gateway, a DHT peer (`swarm_node dht` joined to a bootstrap) — is started against a bootstrap,
the bootstrap is SIGKILLed, and then the process gets SIGTERM. In the ``stuck-p2pd`` cases its own p2pd is frozen
(SIGSTOP) first: the DHT child's shutdown then never finishes, which is how a node was seen hanging forever in
multiprocessing's exit hook (the child ignores hivemind's ``terminate()``). Afterwards nothing the process started
may be left: not its DHT child, not a p2pd.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers.gateway import start_gateway
from tests.helpers.polling import wait_until
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.tiny_models import NUM_LAYERS, GetTinyModel

pytestmark = pytest.mark.timeout(300)

DRAIN = 5.0  # --drain-timeout given to the node and the gateway (the DHT has none)
EXIT_MARGIN = 10.0  # the contract: out within drain + 10 s of SIGTERM


def _start(kind: str, swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel) -> ManagedProcess:
    model = tiny_with_tokenizer("llama").folder
    if kind == "node":
        node = swarm.start_node(model, f"0:{NUM_LAYERS}", "--drain-timeout", str(DRAIN))
        swarm.wait_serving(node)
        return node
    if kind == "gateway":
        return start_gateway(swarm, model, "--drain-timeout", str(DRAIN), wait_ready=False).process
    args = ["swarm_node.cli", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--initial-peers", *swarm.initial_peers]
    peer = swarm._spawn("dht-peer", args)
    wait_until(lambda: "/ip4/127.0.0.1/" in peer.log_text(), within=60)
    return peer


def _descendants(process: ManagedProcess) -> list[psutil.Process]:
    return list(psutil.Process(process.popen.pid).children(recursive=True))


@pytest.mark.parametrize("stuck", [False, True], ids=["", "stuck-p2pd"])
@pytest.mark.parametrize("kind", ["node", "gateway", "dht"])
def test_exits_after_the_bootstrap_is_gone(
    kind: str, stuck: bool, local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    local_swarm.fork = False  # how a process exits is this test's subject: fresh interpreters, as users start them
    local_swarm.start_dht()
    process = _start(kind, local_swarm, tiny_with_tokenizer)
    children = _descendants(process)
    daemons = [child for child in children if child.name() == "p2pd"]
    assert daemons, f"{kind} runs no p2pd: {[child.name() for child in children]}"
    try:
        local_swarm.processes[0].send(signal.SIGKILL)  # the bootstrap, with its DHT child and p2pd
        local_swarm.processes[0].popen.wait()
        if stuck:
            for daemon in daemons:
                daemon.send_signal(signal.SIGSTOP)
        process.send(signal.SIGTERM)
        limit = (0.0 if kind == "dht" else DRAIN) + EXIT_MARGIN
        try:
            code = process.popen.wait(limit)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{kind} still running {limit:.0f}s after SIGTERM:\n{process.log_text()[-3000:]}")
        assert code == 0, f"{kind} exited with {code} after SIGTERM:\n{process.log_text()[-3000:]}"
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"{kind} left {[(p.pid, p.name()) for p in alive]} running"
    finally:
        for child in children:  # a gateway is in the test's own process group: LocalSwarm.close cannot reach these
            with contextlib.suppress(psutil.Error):
                child.kill()


def test_a_dht_stuck_on_the_way_out_is_killed(local_swarm: LocalSwarm) -> None:
    """The helper itself: with the p2pd frozen, ``stop_dht`` returns and the DHT child and its p2pd are gone
    (hivemind's ``shutdown`` alone leaves the p2pd, frozen, behind)."""
    from shared.dht_process import start_dht, stop_dht

    local_swarm.start_dht()
    dht = start_dht(initial_peers=local_swarm.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    children = list(psutil.Process(dht.pid).children(recursive=True))
    try:
        for child in children:
            child.send_signal(signal.SIGSTOP)
        stop_dht(dht, grace=1.0)
        assert not dht.is_alive()
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
    finally:
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        if dht.is_alive():
            dht.kill()


@pytest.mark.parametrize("lost", ["dht-child", "p2pd"])
@pytest.mark.parametrize("kind", ["node", "gateway", "dht"])
def test_exits_with_an_error_when_its_dht_process_dies(
    kind: str, lost: str, local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    """A process whose DHT child (or that child's p2pd) is killed can no longer announce or look anything up: it
    says so and exits with an error (for its supervisor to restart it) rather than running on unseen."""
    local_swarm.fork = False
    local_swarm.start_dht()
    process = _start(kind, local_swarm, tiny_with_tokenizer)
    children = _descendants(process)
    daemons = [child for child in children if child.name() == "p2pd"]
    dht_child = [child for child in children if any(daemon.ppid() == child.pid for daemon in daemons)]
    victim = dht_child[0] if lost == "dht-child" else next(d for d in daemons if d.ppid() == dht_child[0].pid)
    try:
        victim.kill()
        limit = (0.0 if kind == "dht" else DRAIN) + EXIT_MARGIN
        try:
            code = process.popen.wait(limit)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{kind} still running {limit:.0f}s after its {lost} died:\n{process.log_text()[-3000:]}")
        assert code != 0, process.log_text()[-3000:]
        assert "DHT process" in process.log_text(), process.log_text()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"{kind} left {[(p.pid, p.name()) for p in alive]} running"
    finally:
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()


REPO = Path(__file__).parents[2]  # the script imports tests.helpers

# Run in a fresh interpreter: hivemind forks the DHT child, and a fork of a pytest worker that other tests left
# threads in can deadlock before the child is ready.
STARTS_WITH_A_DEAD_DHT = """
import asyncio, sys
from shared.errors import DhtLost
from tests.helpers.dht_kill import killed_as_started

kind, model, peers = sys.argv[1], sys.argv[2], sys.argv[3:]
if kind == "node":
    from swarm_node import server as module
elif kind == "gateway":
    from gateway.model import engine as module
else:
    from swarm_node import dht_bootstrap as module
module.start_dht = killed_as_started(module.start_dht)

async def main():
    if kind == "node":
        from swarm_node.server import SpanServer
        from swarm_node.settings import NodeSettings
        settings = NodeSettings(model=model, blocks="0:2", initial_peers=peers, device="cpu")
        await SpanServer(settings).run(asyncio.Event())
    elif kind == "gateway":
        from gateway.model.engine import GenerationEngine
        from gateway.settings import EngineSettings
        await GenerationEngine.create(EngineSettings(model=model, initial_peers=peers))
    else:
        from swarm_node.settings import DhtSettings
        await module._run_bootstrap(DhtSettings(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers))

try:
    asyncio.run(main())
except DhtLost as lost:
    print(f"DhtLost: {lost}")
    sys.exit(3)
"""


@pytest.mark.parametrize("kind", ["node", "gateway", "dht"])
def test_a_dht_that_dies_while_the_process_starts_stops_it_with_an_error(
    kind: str, local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    """Its DHT child dead before the node has joined (the gateway's engine started, the DHT peer printed its
    addresses): ``DhtLost``, not a wait forever on the dead child's pipe (the first call into it,
    ``replicate_p2p``, blocked the whole event loop)."""
    local_swarm.start_dht()
    model = str(tiny_with_tokenizer("llama").folder)
    args = [sys.executable, "-c", STARTS_WITH_A_DEAD_DHT, kind, model, *local_swarm.initial_peers]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{kind} still starting 120 s after its DHT process died:\n{hung.stderr!r}"[-3000:])
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert "DhtLost: the DHT process" in done.stdout


ASKS_AGAIN_AFTER_ITS_DHT_DIED = """
import asyncio, sys
from shared.dht_process import replicate_p2p, start_dht, stop_dht

async def main():
    dht = start_dht(initial_peers=sys.argv[1:], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    first = await replicate_p2p(dht)
    dht.kill()  # the child only: its p2pd, and with it the replica, lives on
    dht.join(5)
    again = await asyncio.wait_for(replicate_p2p(dht), 10)
    print("the same replica" if again is first else "another replica")
    stop_dht(dht)

asyncio.run(main())
"""


def test_a_replica_once_made_is_handed_back_without_asking_the_dht_again(local_swarm: LocalSwarm) -> None:
    """A node asks for its P2P again after it is settled how peers reach it, when only a watch on a DHT it has since
    stopped stands guard: with its new DHT dead by then, a question to it would wait forever."""
    local_swarm.start_dht()
    args = [sys.executable, "-c", ASKS_AGAIN_AFTER_ITS_DHT_DIED, *local_swarm.initial_peers]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip() == "the same replica"
