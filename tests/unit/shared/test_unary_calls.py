"""A unary call cancelled as its reply arrives leaves every later call answered (``shared.unary_calls``): unguarded,
hivemind's reader task died on that reply and no unary call of the P2P was answered again."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable

from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.proto import p2pd_pb2, runtime_pb2

from shared.unary_calls import WaitingCalls, guard_unary_calls


def _reply(call_id: uuid.UUID, payload: bytes) -> bytes:
    message = p2pd_pb2.PersistentConnectionResponse(
        callId=call_id.bytes, callUnaryResponse=p2pd_pb2.CallUnaryResponse(response=payload)
    ).SerializeToString()
    assert len(message) < 128  # its length fits one varint byte
    return bytes([len(message)]) + message


async def test_the_reader_drops_the_reply_of_a_cancelled_call_and_answers_the_next() -> None:
    guard_unary_calls()
    control = ControlClient(None, _initialized_with_create=True)  # only its reader runs: no daemon
    assert isinstance(control._pending_calls, WaitingCalls)
    loop = asyncio.get_running_loop()
    cancelled, waiting = uuid.uuid4(), uuid.uuid4()
    control._pending_calls[cancelled] = loop.create_future()
    control._pending_calls[cancelled].cancel()  # its caller timed out; its ``finally`` has not run yet
    control._pending_calls[waiting] = loop.create_future()
    replies = asyncio.StreamReader()
    replies.feed_data(_reply(cancelled, b"late") + _reply(waiting, b"answer"))
    replies.feed_eof()
    await asyncio.wait_for(control._read_from_persistent_conn(replies), 5)  # unguarded: InvalidStateError
    assert control._pending_calls[waiting].result() == b"answer"


async def test_calls_timed_out_as_their_replies_arrive_leave_later_calls_answered() -> None:
    guard_unary_calls()
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())

    async def answer(request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        await asyncio.sleep(0.02)
        return runtime_pb2.ExpertResponse()

    def call() -> Awaitable[runtime_pb2.ExpertResponse]:
        request = runtime_pb2.ExpertRequest()
        return client.call_protobuf_handler(server.peer_id, "answer", request, runtime_pb2.ExpertResponse)

    try:
        await server.add_protobuf_handler("answer", answer, runtime_pb2.ExpertRequest)
        for _ in range(300):  # timeouts around the handler's latency: some fire in the turn their reply arrives
            try:
                async with asyncio.timeout(0.015 + random.random() * 0.015):
                    await call()
            except TimeoutError:
                pass
        assert not client._client.control._read_task.done()
        async with asyncio.timeout(10):
            await call()
    finally:
        await client.shutdown()
        await server.shutdown()
