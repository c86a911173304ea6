"""A node's inference stream frees its session's room when the stream's task ends, however it ends: hivemind
cancels the task when the caller cuts the stream, and cancelled while it sends a reply the handler's generator is left
suspended at its ``yield`` (its ``finally`` would wait for the garbage collector)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from shared.wire import PROTOCOL_VERSION, OpenSession, encode_request
from swarm_node.handlers import SpanHandlers


async def test_a_stream_cut_while_its_reply_is_sent_frees_the_session_at_once(
    tiny_span_handlers: tuple[SpanHandlers, P2PContext],
) -> None:
    handlers, context = tiny_span_handlers
    opened = encode_request(OpenSession(protocol=PROTOCOL_VERSION, start=0, end=3, max_length=16))
    sending = asyncio.Event()

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield opened
        await asyncio.Event().wait()  # the caller sends nothing more

    replies = handlers.inference(requests(), context)  # held here: the garbage collector cannot finalize it

    async def process_stream() -> None:  # what hivemind's stream task does: each reply sent as it comes
        async for _ in replies:
            sending.set()
            await asyncio.Event().wait()  # sending the reply when the caller cuts the stream

    task = asyncio.create_task(process_stream())
    await asyncio.wait_for(sending.wait(), 30)
    assert len(handlers.sessions) == 1 and handlers.pool.tokens_left < handlers.pool.total_tokens
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)  # done callbacks run one turn after the task ends
    assert len(handlers.sessions) == 0 and handlers.pool.tokens_left == handlers.pool.total_tokens
