"""A session over part of a node's span holds that part of the pool: its keys and values are allocated for its own
blocks only (``SessionKV``), while the pool counts tokens of the whole span (``shared.kv_charge``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from shared.kv_charge import pool_tokens
from shared.wire import PROTOCOL_VERSION, OpenSession, ResizeSession, encode_request
from swarm_node.handlers import SpanHandlers


def test_a_session_holds_its_blocks_share_of_the_pool_rounded_up() -> None:
    assert pool_tokens(300, 3, 3) == 300  # the whole span: its whole max_length, as before
    assert pool_tokens(300, 1, 3) == 100
    assert pool_tokens(100, 1, 3) == 34  # rounded up: never more memory lent than there is
    assert pool_tokens(1, 1, 48) == 1
    for bad in (0, 4):
        with pytest.raises(ValueError, match="blocks of this span"):
            pool_tokens(300, bad, 3)


async def test_a_node_charges_a_session_over_part_of_its_span_for_those_blocks(
    tiny_span_handlers: tuple[SpanHandlers, P2PContext],
) -> None:
    """Opened on block 0 of a 3-block span, a session of 30 tokens holds 10 of the pool; resized to 60, 20."""
    handlers, context = tiny_span_handlers
    replies: asyncio.Queue[runtime_pb2.ExpertResponse] = asyncio.Queue()
    resize = asyncio.Event()

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield encode_request(OpenSession(protocol=PROTOCOL_VERSION, start=0, end=1, max_length=30))
        await resize.wait()
        yield encode_request(ResizeSession(max_length=60))
        await asyncio.Event().wait()  # the stream stays open: the session keeps its room

    async def read() -> None:
        async for reply in handlers.inference(requests(), context):
            replies.put_nowait(reply)

    task = asyncio.create_task(read())
    try:
        await asyncio.wait_for(replies.get(), 30)
        assert handlers.pool.tokens_left == 256 - 10
        resize.set()
        await asyncio.wait_for(replies.get(), 30)
        assert handlers.pool.tokens_left == 256 - 20
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
