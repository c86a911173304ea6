"""Fail closed, end to end: a real `gateway serve` with an operator key file and a private redis-server that the test
restarts empty and stops, in front of a real node that picked its own block count and serves HTTP probes.

Also: a gateway whose model name no node announces says so in /ready and in its log, and /ready stays 200 (the
process can answer: it answers 503 ``missing_blocks`` itself) while ``/ready?swarm=complete`` is 503.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.helpers.redis_server import RedisServer, free_port
from tests.tiny_models import NUM_LAYERS, TinyModel

pytestmark = pytest.mark.timeout(900)

ADMIN = "sk-operator-from-a-secret-0123456789"


@pytest.fixture(scope="module")
def node(module_swarm: LocalSwarm, chat_model: TinyModel) -> Iterator[tuple[ManagedProcess, int]]:
    """A node started as a volunteer would: neither --blocks nor --num-blocks; probes on its metrics port."""
    try:
        module_swarm.start_dht()
        port = free_port()
        args = ["swarm_node.cli", "serve", str(chat_model.folder), "--num-threads", "1", "--cache-tokens", "4096"]
        args += ["--metrics-port", str(port), "--initial-peers", *module_swarm.initial_peers]
        process = module_swarm._spawn("node-auto", args)
        yield process, port
    finally:
        stop_gracefully(module_swarm)


@pytest.fixture(scope="module")
def gateway(
    module_swarm: LocalSwarm,
    chat_model: TinyModel,
    node: tuple[ManagedProcess, int],
    module_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Gateway:
    key_file = tmp_path_factory.mktemp("secret") / "admin-key"
    key_file.write_text(ADMIN + "\n")
    return start_gateway(
        module_swarm, chat_model.folder, "--redis-url", module_redis.url, "--admin-key-file", str(key_file)
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def create_key(redis_url: str, name: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", "create", name, "--redis-url", redis_url],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def until(predicate: object, what: str, timeout: float = 300.0) -> None:
    """Poll ``predicate`` until true; generous: processes start slowly on a loaded 2-core machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(0.3)
    raise TimeoutError(what)


def test_the_node_chose_its_block_count_and_is_ready_only_once_serving(
    module_swarm: LocalSwarm, node: tuple[ManagedProcess, int]
) -> None:
    process, port = node
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as probes:
        until(lambda: _status(probes, "/health") == 200, "the node's /health never answered")
        module_swarm.wait_serving(process)
        until(lambda: _status(probes, "/ready") == 200, "the serving node never became ready")
        assert f"blocks 0:{NUM_LAYERS}" in probes.get("/ready").text
    log = process.log_text()
    assert f"neither --blocks nor --num-blocks: {NUM_LAYERS} of {NUM_LAYERS} blocks fit" in log
    # Ready came after the span was loaded and announced, never before.
    assert log.index("serving blocks") > log.index("loading blocks")


def _status(client: httpx.Client, path: str) -> int:
    try:
        return client.get(path).status_code
    except httpx.TransportError:
        return 0


def test_keys_refused_after_redis_restarts_empty_and_nothing_opens(gateway: Gateway, module_redis: RedisServer) -> None:
    user = create_key(module_redis.url, "user")
    with gateway.http() as client:
        for path in ("/v1/models", "/v1/sessions"):
            refused = client.get(path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        body = {"model": gateway.model, "prompt": "t4 t5 t6", "max_tokens": 3}
        made = client.post("/v1/completions", json=body, headers=bearer(user))
        assert made.status_code == 200, made.text
        session_id = made.json()["id"]
        assert session_id in [s["id"] for s in client.get("/v1/sessions", headers=bearer(ADMIN)).json()["data"]]

        module_redis.stop()
        module_redis.start()  # the same address, empty: every key made with `gateway keys create` is gone
        until(lambda: client.get("/ready").json()["redis"] == "up", "the gateway never saw Redis back")
        for headers in ({}, bearer(user), bearer("sk-made-up")):
            for path in ("/v1/models", "/v1/sessions", f"/v1/sessions/{session_id}"):
                refused = client.get(path, headers=headers)
                assert refused.status_code == 401, (path, headers, refused.text)
            refused = client.post("/v1/completions", json=body, headers=headers)
            assert refused.status_code == 401
        assert client.post("/v1/completions", json=body, headers=bearer(ADMIN)).status_code == 200  # no Redis needed

        module_redis.stop()  # and while Redis is gone: keys nobody can vouch for are 503, never let in
        try:
            unknown = client.get("/v1/models", headers=bearer("sk-made-up"))
            assert unknown.status_code == 503 and unknown.json()["error"]["code"] == "auth_unavailable"
            assert client.get("/v1/sessions").status_code == 401
            assert client.get("/v1/models", headers=bearer(ADMIN)).status_code == 200
        finally:
            module_redis.start()


def test_a_model_name_no_node_announces_is_named_in_ready_and_the_log(
    module_swarm: LocalSwarm, chat_model: TinyModel, gateway: Gateway, tmp_path: Path
) -> None:
    renamed = tmp_path / "renamed-model"  # the same weights under another name (a symlink would resolve back)
    shutil.copytree(chat_model.folder, renamed)
    other = start_gateway(module_swarm, renamed, wait_ready=False)
    expected = f"no node announces model renamed-model; nodes announce {chat_model.folder.name}"
    with other.http() as client:
        until(lambda: client.get("/ready").json()["swarm"]["message"] == expected, "no model mismatch in /ready")
        ready = client.get("/ready")
        assert ready.status_code == 200 and ready.json()["swarm"]["complete"] is False  # it can answer: ready
        strict = client.get("/ready", params={"swarm": "complete"})
        assert strict.status_code == 503 and strict.json()["error"]["code"] == "missing_blocks"
        assert expected in strict.json()["error"]["message"]
        refused = client.post("/v1/completions", json={"model": other.model, "prompt": "t4", "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "missing_blocks"
    until(lambda: expected in other.log_text(), "the mismatch was never logged")
