"""Node capacity over real processes: batched decode across sessions, a full cache pool, and idle expiry.

Two `swarm_node serve` processes hold blocks 0:3 and 3:6 of a tiny Llama, each with a pool of 1000 tokens, a
20 ms batching window and a 2 s idle timeout; the test drives raw inference streams over hivemind P2P.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from gateway.model.head import build_head
from shared.errors import CacheFull, PositionOutOfRange, UnknownSession
from shared.model_source import load_config, resolve_model
from shared.rpc_client import fetch_info
from shared.weights import open_weights
from shared.wire import (
    INFERENCE_HANDLER,
    PROTOCOL_VERSION,
    ErrorReply,
    NodeInfo,
    OpenSession,
    ResizeSession,
    SessionOpened,
    SessionResized,
    Step,
    StepResult,
    decode_server_message,
    encode_request,
)
from tests.helpers.polling import eventually
from tests.helpers.processes import LocalSwarm
from tests.integration.conftest import client_peer
from tests.tiny_models import VOCAB, GetTinyModel, TinyModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

POOL_TOKENS = 1000
SPANS = ((0, 3), (3, 6))


@pytest.fixture(scope="module")
def capacity_nodes(module_swarm: LocalSwarm, tiny_model: GetTinyModel) -> list[str]:
    module_swarm.start_dht()
    flags = ["--cache-tokens", str(POOL_TOKENS), "--batch-window", "0.02", "--session-idle-timeout", "2"]
    nodes = [module_swarm.start_node(tiny_model("llama").folder, f"{start}:{end}", *flags) for start, end in SPANS]
    return [module_swarm.wait_serving(node) for node in nodes]


class Stream:
    """One inference session on one node, driven by hand."""

    def __init__(self, p2p: P2P, peer: str, blocks: tuple[int, int]) -> None:
        self.p2p, self.peer, self.blocks = p2p, PeerID.from_base58(peer), blocks
        self.outbox: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self.replies: AsyncIterator[runtime_pb2.ExpertResponse] | None = None

    async def open(self, max_length: int, alloc_timeout: float = 0.0) -> None:
        self.replies = await self.p2p.iterate_protobuf_handler(
            self.peer, INFERENCE_HANDLER, self._requests(), runtime_pb2.ExpertResponse
        )
        start, end = self.blocks
        message = OpenSession(
            protocol=PROTOCOL_VERSION, start=start, end=end, max_length=max_length, alloc_timeout=alloc_timeout
        )
        reply, _ = await self._send(encode_request(message))
        assert isinstance(reply, SessionOpened)

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        reply, tensors = await self._send(encode_request(Step(position=position), (hidden,)))
        assert isinstance(reply, StepResult)
        return tensors[0]

    async def resize(self, max_length: int) -> None:
        reply, _ = await self._send(encode_request(ResizeSession(max_length=max_length)))
        assert isinstance(reply, SessionResized) and reply.max_length == max_length

    def close(self) -> None:
        self.outbox.put_nowait(None)  # ends the request stream: the node frees the session

    async def _requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while (item := await self.outbox.get()) is not None:
            yield item

    async def _send(self, request: runtime_pb2.ExpertRequest) -> tuple[object, list[torch.Tensor]]:
        assert self.replies is not None
        self.outbox.put_nowait(request)
        reply, tensors = decode_server_message(await asyncio.wait_for(anext(self.replies), 120))
        if isinstance(reply, ErrorReply):
            raise reply.to_exception()
        return reply, tensors


async def room(p2p: P2P, peers: list[str]) -> list[tuple[int, int]]:
    """(tokens left, sessions) of each node, once both are back to an empty pool or after ~10 s."""
    infos: list[NodeInfo] = []
    for _ in range(100):
        infos = [(await fetch_info(p2p, peer, 30))[0] for peer in peers]
        if all(info.cache_tokens_left == POOL_TOKENS and info.sessions == 0 for info in infos):
            break
        await asyncio.sleep(0.1)
    return [(info.cache_tokens_left, info.sessions) for info in infos]


async def generate(p2p: P2P, peers: list[str], tiny: TinyModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy generation with the head here and the blocks on the two nodes."""
    source = resolve_model(str(tiny.folder))
    head = build_head(load_config(source), open_weights(source, load_config(source)))
    streams = [Stream(p2p, peer, span) for peer, span in zip(peers, SPANS, strict=True)]
    for stream in streams:
        await stream.open(len(prompt) + new_tokens)
    ids, position, tokens = prompt, 0, []
    for _ in range(new_tokens):
        hidden = head.embed(torch.tensor([ids]))
        for stream in streams:
            hidden = await stream.step(hidden, position)
        tokens.append(int(head.logits(hidden)[0, -1].argmax()))
        position, ids = position + len(ids), tokens[-1:]
    for stream in streams:
        stream.close()
    return tokens


async def test_concurrent_sessions_batched_on_the_nodes_match_transformers(
    client_p2p: P2P, capacity_nodes: list[str], tiny_model: GetTinyModel
) -> None:
    tiny = tiny_model("llama")
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in (4, 13, 7, 9)]
    expected = [
        tiny.model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    together = await asyncio.gather(*(generate(client_p2p, capacity_nodes, tiny, p, 10) for p in prompts))
    assert list(together) == expected
    assert await room(client_p2p, capacity_nodes) == [(POOL_TOKENS, 0)] * 2


async def test_fifty_sessions_asking_for_more_than_the_pool_holds(
    client_p2p: P2P, capacity_nodes: list[str], tiny_model: GetTinyModel
) -> None:
    outcomes: list[str] = []

    async def session(index: int) -> None:
        stream = Stream(client_p2p, capacity_nodes[0], SPANS[0])
        try:
            # 50 x 100 tokens against a pool of 1000: half refuse at once when full, half wait up to 3 s for room.
            await stream.open(100, alloc_timeout=0.0 if index % 2 else 3.0)
            await stream.step(torch.randn(1, 5, 64), 0)
            for position in range(5, 8):
                await stream.step(torch.randn(1, 1, 64), position)
            outcomes.append("served")
        except CacheFull:
            outcomes.append("refused")
        finally:
            stream.close()

    await asyncio.gather(*(session(i) for i in range(50)))
    assert len(outcomes) == 50 and outcomes.count("served") >= 10 and "refused" in outcomes
    assert await room(client_p2p, capacity_nodes) == [(POOL_TOKENS, 0)] * 2
    # ... and the node still serves.
    assert len(await generate(client_p2p, capacity_nodes, tiny_model("llama"), [1, 2, 3], 2)) == 2


async def test_an_idle_session_is_expired_and_its_room_freed(client_p2p: P2P, capacity_nodes: list[str]) -> None:
    stream = Stream(client_p2p, capacity_nodes[1], SPANS[1])
    await stream.open(200)
    await stream.step(torch.randn(1, 4, 64), 0)
    info, _ = await fetch_info(client_p2p, capacity_nodes[1], 30)
    assert info.cache_tokens_left == POOL_TOKENS - 200

    async def freed() -> bool:  # idle timeout 2 s, checked every 0.5 s
        info, _ = await fetch_info(client_p2p, capacity_nodes[1], 30)
        return (info.cache_tokens_left, info.sessions) == (POOL_TOKENS, 0)

    await eventually(freed, within=30)
    with pytest.raises(UnknownSession, match="expired"):
        await stream.step(torch.randn(1, 1, 64), 4)
    stream.close()


async def test_a_resized_session_keeps_its_tokens_and_the_pool_counts_its_room(
    client_p2p: P2P, capacity_nodes: list[str], tiny_model: GetTinyModel
) -> None:
    tiny = tiny_model("llama")
    source = resolve_model(str(tiny.folder))
    head = build_head(load_config(source), open_weights(source, load_config(source)))
    prompt = [7, 3, 99, 12, 5, 64, 2, 31]
    expected = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    before = [(await fetch_info(client_p2p, peer, 30))[0].tokens_processed for peer in capacity_nodes]
    streams = [Stream(client_p2p, peer, span) for peer, span in zip(capacity_nodes, SPANS, strict=True)]
    for stream in streams:
        await stream.open(len(prompt))  # room for the prompt only, as a kept conversation shrunk to what it holds
    hidden = head.embed(torch.tensor([prompt]))
    for stream in streams:
        hidden = await stream.step(hidden, 0)
    for stream in streams:
        await stream.resize(len(prompt) + 6)
    infos = [(await fetch_info(client_p2p, peer, 30))[0] for peer in capacity_nodes]
    assert [(info.cache_tokens_left, info.sessions) for info in infos] == [(POOL_TOKENS - 14, 1)] * 2
    tokens = [int(head.logits(hidden)[0, -1].argmax())]
    for position in range(len(prompt), len(prompt) + 5):  # decoding on after the growth: the stored keys survived
        hidden = head.embed(torch.tensor([tokens[-1:]]))
        for stream in streams:
            hidden = await stream.step(hidden, position)
        tokens.append(int(head.logits(hidden)[0, -1].argmax()))
    assert tokens == expected
    after = [(await fetch_info(client_p2p, peer, 30))[0].tokens_processed for peer in capacity_nodes]
    assert [b - a for a, b in zip(before, after, strict=True)] == [len(prompt) + 5] * 2

    first = streams[0]
    await first.resize(13)  # shrunk to the 13 tokens it holds: the rest goes back to the pool at once
    assert (await fetch_info(client_p2p, capacity_nodes[0], 30))[0].cache_tokens_left == POOL_TOKENS - 13
    with pytest.raises(PositionOutOfRange, match="below the 13 stored"):
        await first.resize(12)
    with pytest.raises(PositionOutOfRange, match="exceeds this node's limit"):
        await first.resize(100_000)
    others = [Stream(client_p2p, capacity_nodes[0], SPANS[0]) for _ in range(4)]
    for other, length in zip(others, (250, 250, 250, 230), strict=True):
        await other.open(length)
    with pytest.raises(CacheFull, match="8 tokens asked, 7 free"):  # growth is granted like an open
        await first.resize(21)
    for other in others:
        other.close()
    for stream in streams:
        stream.close()
    assert await room(client_p2p, capacity_nodes) == [(POOL_TOKENS, 0)] * 2


async def test_one_peer_cannot_take_more_than_its_share_while_another_uses_the_node(
    capacity_nodes: list[str], module_swarm: LocalSwarm
) -> None:
    """Two clients (two peer ids) against one node with the default share, half the pool while the other is here."""
    node = capacity_nodes[0]
    async with client_peer(module_swarm.initial_peers) as greedy, client_peer(module_swarm.initial_peers) as other:
        mine = [Stream(greedy, node, SPANS[0]) for _ in range(5)]
        for stream in mine[:4]:
            await stream.open(200)  # alone on the node: 800 of its 1000 tokens
        theirs = [Stream(other, node, SPANS[0]) for _ in range(2)]
        await theirs[0].open(50)
        with pytest.raises(CacheFull, match="exceed its fair share of 500 while other peers use this node"):
            await mine[4].open(10)  # room is left, but not for the peer over its share
        await theirs[1].open(100)  # the other peer gets the room
        for stream in theirs:
            stream.close()

        async def only_mine_left() -> bool:
            return (await fetch_info(other, node, 30))[0].sessions == 4

        await eventually(only_mine_left)
        mine[4].close()
        mine[4] = Stream(greedy, node, SPANS[0])
        await mine[4].open(10)  # alone again: no share to keep
        for stream in mine:
            stream.close()
        assert (await room(other, [node]))[0] == (POOL_TOKENS, 0)
