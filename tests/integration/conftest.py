"""Integration fixtures: real swarm processes on 127.0.0.1 and a DHT client for the test itself."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import hivemind
import pytest
from hivemind.p2p import P2P
from transformers import AutoTokenizer

from shared.dht_records import ModelRecord, ServerRecord
from shared.membership import record_validators
from tests.helpers.gateway import stop_gracefully
from tests.helpers.processes import LocalSwarm, save_tiny_tokenizer
from tests.helpers.redis_server import RedisServer, running_redis
from tests.helpers.smollm2 import SmolLM2Nodes, start_smollm2_nodes
from tests.tiny_models import NUM_LAYERS, VOCAB, GetTinyModel, TinyModel


@pytest.fixture
def local_swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(scope="module")
def module_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(tmp_path_factory.mktemp("swarm"))
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture(scope="session")
def smollm2_nodes(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[SmolLM2Nodes]:
    """SmolLM2's two nodes and their DHT, started once per xdist worker and shared by the modules that reach them
    only through gateways of their own (``smollm2_swarm``): a start costs some 30 s of this machine's two cores."""
    swarm = LocalSwarm(tmp_path_factory.mktemp("smollm2-nodes"))
    try:
        yield start_smollm2_nodes(swarm, smollm2_gguf)
    finally:
        stop_gracefully(swarm)
        swarm.close()


@pytest.fixture(scope="module")
def smollm2_swarm(module_swarm: LocalSwarm, smollm2_nodes: SmolLM2Nodes) -> LocalSwarm:
    """The module's own swarm on the shared SmolLM2 nodes: the gateways it starts stop with the module, and it starts
    once the nodes are free of the sessions of the module before."""
    smollm2_nodes.wait_idle()
    module_swarm.initial_peers = list(smollm2_nodes.swarm.initial_peers)
    return module_swarm


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tiny_model: GetTinyModel) -> GetTinyModel:
    """``tiny_with_tokenizer(variant)``: the tiny model's folder with a word-level tokenizer saved beside it."""

    def get(variant: str) -> TinyModel:
        tiny = tiny_model(variant)
        if not (tiny.folder / "tokenizer.json").exists():
            save_tiny_tokenizer(tiny.folder, VOCAB)
        return tiny

    return get


def client_dht(initial_peers: list[str], secret: bytes | None = None) -> hivemind.DHT:
    """A DHT client for the test itself, with the same record validators as every swarmgate process."""
    return hivemind.DHT(
        initial_peers=initial_peers,
        client_mode=True,
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
        record_validators=record_validators(secret, (ServerRecord, ModelRecord)),
    )


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server the module's tests share (gateways started once per module use it); they may freeze,
    kill or restart it. ``redis_server`` (tests/conftest.py) is one per test."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def node_peer(module_swarm: LocalSwarm, tiny_model: GetTinyModel) -> str:
    """One node serving every block of the tiny llama (300 cache tokens), for tests that drive its RPCs directly."""
    module_swarm.start_dht()
    node = module_swarm.start_node(tiny_model("llama").folder, f"0:{NUM_LAYERS}", "--cache-tokens", "300")
    return module_swarm.wait_serving(node)


@contextlib.asynccontextmanager
async def client_peer(initial_peers: list[str]) -> AsyncIterator[P2P]:
    """A client-mode DHT peer of the swarm, shut down on exit: its P2P speaks to the nodes."""
    dht = client_dht(initial_peers)
    try:
        yield await dht.replicate_p2p()
    finally:
        dht.shutdown()


@pytest.fixture
async def client_p2p(module_swarm: LocalSwarm) -> AsyncIterator[P2P]:
    async with client_peer(module_swarm.initial_peers) as p2p:
        yield p2p


CONTEXT = 1024  # longer than the tiny model's own, so long generations can be cancelled mid-way
CHAT_TEMPLATE = (
    "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t3{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model: GetTinyModel, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny Llama with a longer context window and a tokenizer that has a chat template."""
    tiny = tiny_model("llama")
    folder = tmp_path_factory.mktemp("tiny-llama-chat")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny.folder / name, folder / name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    save_tiny_tokenizer(folder, VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return TinyModel(folder, tiny.model)
