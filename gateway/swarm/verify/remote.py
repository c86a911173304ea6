"""The two ways a check runs blocks on a node: as a user's session does (``session_outputs``: a prefill, then one
decode step on the node's KV cache) and as a stateless forward (``forward_outputs``: one prefill of every position,
no state kept; what a reference replica is asked)."""

from __future__ import annotations

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from gateway.swarm.node_session import NodeSession
from gateway.swarm.routing import Hop
from shared import wire
from shared.errors import MalformedReply
from shared.membership import CallAuth
from shared.rpc_client import decode_reply, over_transport


async def forward_outputs(
    p2p: P2P,
    peer_id: str,
    blocks: tuple[int, int],
    hidden: torch.Tensor,
    limit: float,
    auth: CallAuth,
    adapter: str | None = None,
) -> torch.Tensor:
    """hidden [1, T, D] through ``blocks`` on ``peer_id`` as one stateless prefill (with ``adapter``) -> [1, T, D]."""
    start, end = blocks
    token = auth.token_for(peer_id)
    message = wire.ForwardRequest(protocol=wire.PROTOCOL_VERSION, start=start, end=end, auth=token, adapter=adapter)
    call = p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id),
        wire.FORWARD_HANDLER,
        wire.encode_request(message, (hidden,)),
        runtime_pb2.ExpertResponse,
    )
    response = await over_transport(peer_id, "answer a check's forward", call, limit)
    reply, tensors = decode_reply(response, peer_id)
    if not isinstance(reply, wire.ForwardResult) or len(tensors) != 1 or tensors[0].shape != hidden.shape:
        raise MalformedReply(f"node {peer_id} sent a malformed forward result")
    return tensors[0]


async def session_outputs(
    p2p: P2P, peer_id: str, blocks: tuple[int, int], hidden: torch.Tensor, limit: float, auth: CallAuth
) -> torch.Tensor:
    """hidden [1, T, D] through ``blocks`` in a session on ``peer_id``: positions 0..T-2 as a prefill, then T-1 as
    a decode step on the cache the prefill wrote -> [1, T, D] (a node that never writes its cache fails here)."""
    session = NodeSession(p2p, Hop(peer_id, *blocks), hidden.shape[1], limit, auth)
    try:
        await session.open()
        head = await session.step(hidden[:, :-1], 0)
        tail = await session.step(hidden[:, -1:], hidden.shape[1] - 1)
    finally:
        await session.close()
    return torch.cat([head, tail], dim=1)
