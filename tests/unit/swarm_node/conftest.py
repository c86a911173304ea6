"""Fixtures of the node's unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hivemind.p2p import P2PContext, PeerID

from shared.dht_records import NodeState
from shared.identity import new_identity
from shared.model_source import load_config, resolve_model
from shared.receipts import StepKey
from shared.weights import open_weights
from swarm_node.backend import SpanBackend
from swarm_node.cache_pool import CachePool
from swarm_node.handlers import NodeStatus, SpanHandlers
from swarm_node.span import build_span
from tests.tiny_models import GetTinyModel


@pytest.fixture
def tiny_span_handlers(tiny_model: GetTinyModel) -> Iterator[tuple[SpanHandlers, P2PContext]]:
    """The RPC handlers of an online node serving blocks 0:3 of the tiny llama with a pool of 256 tokens, and the
    context hivemind would hand them for an inference stream: the node's handlers called in-process."""
    source = resolve_model(str(tiny_model("llama").folder))
    config = load_config(source)
    backend = SpanBackend(build_span(config, open_weights(source, config), 0, 3))
    identity = new_identity()
    status = NodeStatus("tiny", "t", 64, state=NodeState.ONLINE, step_key=StepKey(identity.key))
    peer = PeerID.from_base58(identity.peer_id)
    try:
        yield SpanHandlers(backend, CachePool(256), status), P2PContext("inference", peer, peer)
    finally:
        backend.shutdown()
