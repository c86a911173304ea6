"""A node runs its known-answer self-test before its first DHT record: one whose cache keeps nothing
(``--faulty-outputs stale-cache``) exits non-zero saying so and never appears in the DHT; an honest one serves;
``--skip-self-test`` (testing only) lets the liar start, so the gateway's own checks can be tested against it."""

from __future__ import annotations

import time

import pytest

from shared.dht_records import fetch_servers
from shared.model_source import resolve_model
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.integration.conftest import client_dht
from tests.tiny_models import NUM_LAYERS, GetTinyModel

pytestmark = pytest.mark.timeout(300)


def _wait_exit(node: ManagedProcess, limit: float = 180.0) -> int:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if node.popen.poll() is not None:
            return node.popen.returncode
        time.sleep(0.2)
    raise TimeoutError(f"{node.name} is still running:\n{node.log_text()[-3000:]}")


async def test_a_node_failing_its_self_test_exits_and_is_never_announced(
    local_swarm: LocalSwarm, tiny_model: GetTinyModel
) -> None:
    folder = tiny_model("llama").folder
    local_swarm.start_dht()
    stale = local_swarm.start_node(folder, "0:6", "--faulty-outputs", "stale-cache", name="stale")
    honest = local_swarm.start_node(folder, "0:6", name="honest")
    skipped = local_swarm.start_node(folder, "0:6", "--faulty-outputs", "stale-cache", "--skip-self-test", name="skip")
    assert _wait_exit(stale) == 1
    log = stale.log_text()
    assert "self-test failed, not announcing this node: decode after a prefill of 7 positions is off by" in log
    assert "KV cache does not keep keys/values" in log and "Traceback" not in log
    peers = {local_swarm.wait_serving(honest), local_swarm.wait_serving(skipped)}
    assert "serving blocks" not in log
    dht = client_dht(local_swarm.initial_peers)
    try:
        servers = await fetch_servers(dht, resolve_model(str(folder)).name, NUM_LAYERS)
        assert set(servers) == peers, servers
    finally:
        dht.shutdown()
    assert "--skip-self-test: serving a span whose known-answer test did not run" in skipped.log_text()
    assert "self-test passed: decode after a prefill of 7 positions" in honest.log_text()
