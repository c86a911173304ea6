"""A node whose DHT child hangs (frozen, not dead) is not ready: its records expire and nobody can find it, so its
readiness probe says so, and its announcements fail loudly (each bounded by the record's lifetime) instead of
waiting forever. Once the child answers again, the node announces and is ready again."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.helpers.polling import wait_until
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.helpers.redis_server import free_port
from tests.tiny_models import NUM_LAYERS, GetTinyModel

pytestmark = pytest.mark.timeout(240)

ANNOUNCE_PERIOD = 1.0  # its records live 2 x 1 + 5 = 7 s


@pytest.fixture
def node(local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel) -> Iterator[tuple[ManagedProcess, int]]:
    local_swarm.start_dht()
    port = free_port()
    process = local_swarm.start_node(
        tiny_with_tokenizer("llama").folder,
        f"0:{NUM_LAYERS}",
        "--announce-period",
        str(ANNOUNCE_PERIOD),
        "--metrics-port",
        str(port),
    )
    local_swarm.wait_serving(process)
    yield process, port


def _dht_child(process: ManagedProcess) -> psutil.Process:
    children = psutil.Process(process.popen.pid).children(recursive=True)
    daemons = [child for child in children if child.name() == "p2pd"]
    return next(child for child in children if any(daemon.ppid() == child.pid for daemon in daemons))


def _ready(probes: httpx.Client) -> tuple[int, str]:
    reply = probes.get("/ready")
    return reply.status_code, reply.text


def test_a_node_whose_dht_child_hangs_is_not_ready_until_it_announces_again(node: tuple[ManagedProcess, int]) -> None:
    process, port = node
    child = _dht_child(process)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as probes:
        wait_until(lambda: _ready(probes)[0] == 200, within=60)
        child.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: _ready(probes)[0] == 503, within=30)
            assert "unannounced" in _ready(probes)[1]
            assert _ready(probes)[0] == 503  # and stays so while the child hangs
            wait_until(lambda: "DHT announcement failed" in process.log_text(), within=30)
        finally:
            with contextlib.suppress(psutil.Error):
                child.send_signal(signal.SIGCONT)
        wait_until(lambda: _ready(probes)[0] == 200, within=60)
    assert process.popen.poll() is None
