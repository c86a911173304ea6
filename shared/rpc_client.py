"""Unary calls to a node: its info (also the latency probe of gateways and of nodes measuring their next hops)."""

from __future__ import annotations

import asyncio
import time

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from shared.errors import NodeUnreachable, RemoteError, StepTimeout
from shared.membership import CallAuth
from shared.protocol import INFO_HANDLER, ErrorReply, InfoRequest, NodeInfo, decode_server_message, encode_request


async def fetch_info(p2p: P2P, peer_id: str, wait: float, auth: CallAuth | None = None) -> tuple[NodeInfo, float]:
    """The node's info and the round-trip time of the call, in seconds."""
    began = time.perf_counter()
    try:
        response = await asyncio.wait_for(
            p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id),
                INFO_HANDLER,
                encode_request(InfoRequest(auth=auth.token_for(peer_id) if auth else None)),
                runtime_pb2.ExpertResponse,
            ),
            wait,
        )
    except TimeoutError:
        raise StepTimeout(f"node {peer_id} did not answer info within {wait}s") from None
    except Exception as exc:
        raise NodeUnreachable(f"cannot reach node {peer_id}: {exc}") from exc
    rtt = time.perf_counter() - began
    try:
        reply, _ = decode_server_message(response)
    except RemoteError as exc:
        raise NodeUnreachable(f"node {peer_id} sent an unreadable info reply: {exc}") from None
    if isinstance(reply, ErrorReply):
        raise reply.to_exception()
    if not isinstance(reply, NodeInfo):
        raise NodeUnreachable(f"node {peer_id} answered info with {reply.type!r}")
    return reply, rtt
