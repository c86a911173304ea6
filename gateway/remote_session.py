"""Sessions on remote nodes: one inference stream per hop, and a chain of them that carries hidden states.

Each ``NodeSession`` owns one hivemind stream: requests go through a queue the stream reads, every reply is awaited
under the step timeout, and transport failures surface as ``NodeUnreachable`` / ``StepTimeout`` (typed node
errors are rebuilt from their codes). Closing is idempotent and always releases the node's cache room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from pydantic import BaseModel

from gateway.routing import Hop
from shared.errors import NodeUnreachable, RemoteError, StepTimeout
from shared.protocol import (
    INFERENCE_HANDLER,
    PROTOCOL_VERSION,
    CloseSession,
    ErrorReply,
    OpenSession,
    ServerMessage,
    SessionOpened,
    Step,
    StepResult,
    decode_server_message,
    encode_request,
)

logger = logging.getLogger(__name__)

_CLOSED = None  # sentinel that ends the request stream


class NodeSession:
    """An inference session on one node for blocks [hop.start, hop.end)."""

    def __init__(self, p2p: P2P, hop: Hop, max_length: int, step_timeout: float) -> None:
        self.hop = hop
        self.max_length = max_length
        self._p2p = p2p
        self._timeout = step_timeout
        self._outbox: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self._replies: AsyncIterator[runtime_pb2.ExpertResponse] | None = None
        self.closed = False

    async def open(self) -> None:
        try:
            self._replies = await asyncio.wait_for(
                self._p2p.iterate_protobuf_handler(
                    PeerID.from_base58(self.hop.peer_id),
                    INFERENCE_HANDLER,
                    self._requests(),
                    runtime_pb2.ExpertResponse,
                ),
                self._timeout,
            )
        except TimeoutError:
            raise StepTimeout(f"node {self.hop.peer_id} did not accept a stream in {self._timeout}s") from None
        except Exception as exc:
            raise NodeUnreachable(f"cannot reach node {self.hop.peer_id}: {exc}") from exc
        opened = OpenSession(
            protocol=PROTOCOL_VERSION, start=self.hop.start, end=self.hop.end, max_length=self.max_length
        )
        reply, _ = await self._exchange(opened)
        if not isinstance(reply, SessionOpened):
            raise NodeUnreachable(f"node {self.hop.peer_id} answered {reply.type!r} to open")

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, T, D] at positions position... -> the hop's output [1, T, D]."""
        reply, tensors = await self._exchange(Step(position=position), (hidden,))
        if not isinstance(reply, StepResult) or len(tensors) != 1 or tensors[0].shape != hidden.shape:
            raise NodeUnreachable(f"node {self.hop.peer_id} sent a malformed step result")
        return tensors[0]

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._outbox.put_nowait(encode_request(CloseSession()))
        self._outbox.put_nowait(_CLOSED)
        if self._replies is not None:
            aclose = getattr(self._replies, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while (request := await self._outbox.get()) is not _CLOSED:
            yield request

    async def _exchange(
        self, message: BaseModel, tensors: tuple[torch.Tensor, ...] = ()
    ) -> tuple[ServerMessage, list[torch.Tensor]]:
        if self.closed or self._replies is None:
            raise NodeUnreachable(f"session on {self.hop.peer_id} is closed")
        self._outbox.put_nowait(encode_request(message, tensors))
        try:
            response = await asyncio.wait_for(anext(self._replies), self._timeout)
        except TimeoutError:
            raise StepTimeout(f"node {self.hop.peer_id} did not answer within {self._timeout}s") from None
        except StopAsyncIteration:
            raise NodeUnreachable(f"node {self.hop.peer_id} closed the session") from None
        except Exception as exc:
            raise NodeUnreachable(f"lost node {self.hop.peer_id}: {exc}") from exc
        try:
            reply, out = decode_server_message(response)
        except RemoteError as exc:
            raise NodeUnreachable(f"node {self.hop.peer_id} sent an unreadable reply: {exc}") from None
        if isinstance(reply, ErrorReply):
            raise reply.to_exception()
        return reply, out


class ChainSession:
    """A session through every hop of a route: hidden states go in at the first block and out after the last."""

    def __init__(self, p2p: P2P, hops: Sequence[Hop], max_length: int, step_timeout: float) -> None:
        self.hops = list(hops)
        self._sessions = [NodeSession(p2p, hop, max_length, step_timeout) for hop in hops]

    async def __aenter__(self) -> ChainSession:
        try:
            await asyncio.gather(*(session.open() for session in self._sessions))
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, T, D] embeddings of new tokens -> [1, T, D] output of the last block."""
        for session in self._sessions:
            hidden = await session.step(hidden, position)
        return hidden

    async def close(self) -> None:
        # Shielded: a cancelled request must still release every node's cache room.
        await asyncio.shield(asyncio.gather(*(s.close() for s in self._sessions), return_exceptions=True))
