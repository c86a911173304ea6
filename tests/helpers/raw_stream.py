"""A hand-driven stream to a node's stream handler, to send what a well-behaved client never would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from shared.wire import INFERENCE_HANDLER, decode_server_message


class RawStream:
    def __init__(self, p2p: P2P, peer: str, handler: str = INFERENCE_HANDLER) -> None:
        self.p2p, self.peer, self.handler = p2p, PeerID.from_base58(peer), handler
        self.outbox: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()

    async def __aenter__(self) -> RawStream:
        self.replies = await self.p2p.iterate_protobuf_handler(
            self.peer, self.handler, self._requests(), runtime_pb2.ExpertResponse
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.outbox.put_nowait(None)

    async def _requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while (item := await self.outbox.get()) is not None:
            yield item

    async def send(self, request: runtime_pb2.ExpertRequest) -> tuple[object, list[torch.Tensor]]:
        self.outbox.put_nowait(request)
        return decode_server_message(await asyncio.wait_for(anext(self.replies), 60))
