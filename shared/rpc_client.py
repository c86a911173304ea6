"""Talking to a node over hivemind: the one place a transport failure becomes a typed error, and the info RPC (also
the latency probe of gateways and of nodes measuring their next hops, and the gateway's liveness ping).

Every await on a node — opening a stream, the next reply of a stream, a unary call — goes through ``over_transport``:

    TimeoutError                      -> StepTimeout     (no answer in time)
    StopAsyncIteration                -> NodeUnreachable (the node ended the stream)
    any other transport exception     -> NodeUnreachable (hivemind P2P errors: stream reset, failed dial, ...)

and every reply through ``decode_reply``: an unreadable one is ``MalformedReply``, an ``ErrorReply`` is raised as the
typed error its code names.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from shared.errors import MalformedReply, NodeUnreachable, RemoteError, StepTimeout, SwarmError
from shared.membership import CallAuth
from shared.wire import (
    INFO_HANDLER,
    ErrorReply,
    InfoRequest,
    NodeInfo,
    ServerMessage,
    decode_server_message,
    encode_request,
)

T = TypeVar("T")


async def over_transport(peer_id: str, what: str, work: Awaitable[T], limit: float | None) -> T:
    """Await ``work`` (one transport operation with node ``peer_id``: ``what`` names it in errors) for up to
    ``limit`` seconds (None: no limit); its failures come out typed (module docstring). Cancelling the caller
    cancels ``work``."""
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result of work that completes just as
        # the caller is cancelled, dropping the cancel (a generation stopped that way decoded on to its end).
        async with asyncio.timeout(limit):
            return await work
    except TimeoutError:
        raise StepTimeout(f"node {peer_id} did not {what} within {limit:g}s") from None
    except StopAsyncIteration:
        raise NodeUnreachable(f"node {peer_id} closed the stream") from None
    except SwarmError:
        raise
    except Exception as exc:
        raise NodeUnreachable(f"lost node {peer_id} ({what}): {exc}") from exc


def decode_reply(response: runtime_pb2.ExpertResponse, peer_id: str) -> tuple[ServerMessage, list[torch.Tensor]]:
    """A node's reply and its tensors; raises the node's typed error, or ``MalformedReply`` for garbage."""
    try:
        reply, tensors = decode_server_message(response)
    except RemoteError as exc:
        raise MalformedReply(f"node {peer_id} sent an unreadable reply: {exc}") from None
    if isinstance(reply, ErrorReply):
        raise reply.to_exception()
    return reply, tensors


async def fetch_info(p2p: P2P, peer_id: str, wait: float, auth: CallAuth | None = None) -> tuple[NodeInfo, float]:
    """The node's info and the round-trip time of the call, in seconds."""
    began = time.perf_counter()
    request = encode_request(InfoRequest(auth=auth.token_for(peer_id) if auth else None))
    call = p2p.call_protobuf_handler(PeerID.from_base58(peer_id), INFO_HANDLER, request, runtime_pb2.ExpertResponse)
    response = await over_transport(peer_id, "answer info", call, wait)
    rtt = time.perf_counter() - began
    reply, _ = decode_reply(response, peer_id)
    if not isinstance(reply, NodeInfo):
        raise MalformedReply(f"node {peer_id} answered info with {reply.type!r}")
    return reply, rtt
