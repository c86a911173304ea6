"""A node runs its known-answer self-test before its first DHT record: one whose cache keeps nothing
(``--faulty-outputs stale-cache``) exits non-zero saying so and never appears in the DHT; an honest one serves;
``--skip-self-test`` (testing only) lets the liar start, so the gateway's own checks can be tested against it."""

from __future__ import annotations

import time

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from shared.dht_records import fetch_servers
from shared.model_source import resolve_model
from shared.wire import FORWARD_HANDLER, PROTOCOL_VERSION, ForwardRequest, decode_server_message, encode_request
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.integration.conftest import client_dht, client_peer
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


async def _forward(p2p: P2P, peer: str, hidden: torch.Tensor) -> torch.Tensor:
    request = encode_request(ForwardRequest(protocol=PROTOCOL_VERSION, start=0, end=NUM_LAYERS), (hidden,))
    response = await p2p.call_protobuf_handler(
        PeerID.from_base58(peer), FORWARD_HANDLER, request, runtime_pb2.ExpertResponse
    )
    _, (output,) = decode_server_message(response)
    return output


async def test_the_healthy_looking_liars_pass_start_up_and_answer_well_formed_wrong_states(
    local_swarm: LocalSwarm, tiny_model: GetTinyModel
) -> None:
    """What the gateway's own checks must catch: each starts like an honest node and answers the right shape and
    dtype, finite, but not the honest node's numbers (each wrong by its own amount)."""
    folder = tiny_model("llama").folder
    local_swarm.start_dht()
    modes = ("none", "noise", "wrong-weights", "low-precision", "lazy")
    nodes = {mode: local_swarm.start_node(folder, "0:6", "--faulty-outputs", mode, name=mode) for mode in modes}
    peers = {mode: local_swarm.wait_serving(node) for mode, node in nodes.items()}
    hidden = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    async with client_peer(local_swarm.initial_peers) as p2p:
        outputs = {mode: await _forward(p2p, peer, hidden) for mode, peer in peers.items()}
    honest = outputs.pop("none")
    errors = {mode: float((out - honest).norm() / (honest - hidden).norm()) for mode, out in outputs.items()}
    for mode, output in outputs.items():
        assert output.shape == honest.shape and output.dtype == honest.dtype and torch.isfinite(output).all(), mode
    assert torch.equal(outputs["lazy"], hidden)
    assert 0.001 < errors["noise"] < 0.1 and errors["wrong-weights"] > 0.05 and errors["low-precision"] > 0.01, errors
    for mode, node in nodes.items():
        assert "self-test passed: decode after a prefill of 7 positions" in node.log_text(), mode
