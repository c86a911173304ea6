"""Sessions on remote nodes: one inference stream per hop, and a chain of them that carries hidden states.

Each ``NodeSession`` owns one hivemind stream: requests go through a queue the stream reads, every reply is awaited
under the step timeout, and transport failures surface as ``NodeUnreachable`` / ``StepTimeout`` (typed node
errors are rebuilt from their codes). Decode steps (one token) go through the gateway's ``StepLinks`` instead when it
has them, batched with other sessions' steps to the same node. Closing is idempotent and always releases the node's
cache room.

With push on (``ChainSession(push=True)``), a decode step goes to the chain's first node together with the rest of
the route and each node pushes its output straight to the next one; the gateway hears every hop's input and output
(``gateway.swarm.push_step``), so failover replays exactly as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from pydantic import BaseModel

from gateway.metrics import chain_opened
from gateway.swarm.push_step import push_step
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from gateway.swarm.step_links import StepLinks
from shared.errors import NodeUnreachable, RemoteError, StepTimeout
from shared.membership import CallAuth
from shared.protocol import (
    INFERENCE_HANDLER,
    PROTOCOL_VERSION,
    AllowPush,
    CloseSession,
    ErrorReply,
    NextHop,
    OpenSession,
    PushAllowed,
    ResizeSession,
    ServerMessage,
    SessionOpened,
    SessionResized,
    Step,
    StepResult,
    decode_server_message,
    encode_request,
)

logger = logging.getLogger(__name__)

_CLOSED = None  # sentinel that ends the request stream


class NodeSession:
    """An inference session on one node for blocks [hop.start, hop.end)."""

    def __init__(
        self,
        p2p: P2P,
        hop: Hop,
        max_length: int,
        step_timeout: float,
        auth: CallAuth | None = None,
        links: StepLinks | None = None,
    ) -> None:
        self.hop = hop
        self._links = links
        self._session_id: str | None = None  # the node's name for it, once opened
        self._auth = auth
        self.max_length = max_length
        self.pusher: str | None = None  # the node before this one, named at open: it may push steps here
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
            protocol=PROTOCOL_VERSION,
            start=self.hop.start,
            end=self.hop.end,
            max_length=self.max_length,
            auth=self._auth.token_for(self.hop.peer_id) if self._auth else None,
            pusher=self.pusher,
        )
        reply, _ = await self._exchange(opened)
        if not isinstance(reply, SessionOpened):
            raise NodeUnreachable(f"node {self.hop.peer_id} answered {reply.type!r} to open")
        self._session_id = reply.session_id

    @property
    def next_hop(self) -> NextHop | None:
        """How the node before this one names it in a push: None until opened (or without step links)."""
        if self._session_id is None or self._links is None or self.closed:
            return None
        return NextHop(peer_id=self.hop.peer_id, session_id=self._session_id)

    async def step(self, hidden: torch.Tensor, position: int, next: list[NextHop] | None = None) -> torch.Tensor:
        """hidden: [1, T, D] at positions position... -> the hop's output [1, T, D]; a decode step's output is also
        pushed along ``next`` (the rest of the chain)."""
        if hidden.shape[1] == 1 and self._links is not None and self._session_id is not None:
            if self.closed:
                raise NodeUnreachable(f"session on {self.hop.peer_id} is closed")
            output = await self._links.step(self.hop.peer_id, self._session_id, hidden, position, next or ())
            return self._checked_output(output, hidden)
        reply, tensors = await self._exchange(Step(position=position), (hidden,))
        return self._checked(reply, tensors, hidden)

    def _checked(self, reply: ServerMessage, tensors: list[torch.Tensor], sent: torch.Tensor) -> torch.Tensor:
        if not isinstance(reply, StepResult) or len(tensors) != 1:
            raise NodeUnreachable(f"node {self.hop.peer_id} sent a malformed step result")
        return self._checked_output(tensors[0], sent)

    def _checked_output(self, output: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """The step's output if it is one: the shape and dtype of what was sent, every value finite. A node that
        answers anything else is broken (or lying): failing here bans it and routes around it, and none of its
        garbage reaches a sampled token."""
        if output.shape != sent.shape or output.dtype != sent.dtype:
            raise NodeUnreachable(
                f"node {self.hop.peer_id} sent {tuple(output.shape)} {output.dtype}"
                f" for {tuple(sent.shape)} {sent.dtype}"
            )
        if not bool(torch.isfinite(output).all()):
            raise NodeUnreachable(f"node {self.hop.peer_id} sent non-finite hidden states")
        return output

    async def pushed(self, position: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of the decode step at ``position`` pushed here by the previous node; ``like`` is the
        chain's input [1, 1, D], whose shape and dtype every hop keeps."""
        if self.closed or self._links is None or self._session_id is None:
            raise NodeUnreachable(f"session on {self.hop.peer_id} is closed")
        received, output = await self._links.pushed(self.hop.peer_id, self._session_id, position, self._timeout)
        return self._checked_output(received, like), self._checked_output(output, like)

    async def allow_push(self, pusher: str | None) -> None:
        """Let ``pusher`` (this hop's new predecessor) push steps into the session."""
        reply, _ = await self._exchange(AllowPush(pusher=pusher))
        if not isinstance(reply, PushAllowed):
            raise NodeUnreachable(f"node {self.hop.peer_id} sent a malformed allow-push reply")
        self.pusher = pusher

    async def resize(self, max_length: int) -> None:
        """Grow or shrink the node's room for this session; its stored tokens stay."""
        reply, _ = await self._exchange(ResizeSession(max_length=max_length))
        if not isinstance(reply, SessionResized) or reply.max_length != max_length:
            raise NodeUnreachable(f"node {self.hop.peer_id} sent a malformed resize reply")
        self.max_length = max_length

    async def replay(self, chunks: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """Send past inputs in their original chunks, pipelined (all sent, then all read): the node computes exactly
        what the lost node had, at one round trip's cost. Returns the outputs with their positions."""
        if self.closed or self._replies is None:
            raise NodeUnreachable(f"session on {self.hop.peer_id} is closed")
        for position, hidden in chunks:
            self._outbox.put_nowait(encode_request(Step(position=position), (hidden,)))
        outputs = []
        for position, hidden in chunks:
            reply, tensors = await self._receive()
            outputs.append((position, self._checked(reply, tensors, hidden)))
        return outputs

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
        return await self._receive()

    async def _receive(self) -> tuple[ServerMessage, list[torch.Tensor]]:
        assert self._replies is not None  # opened before anything is sent
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


@dataclass
class Segment:
    """One hop of a chain and every input it was given, kept so a replacement can be replayed exactly."""

    session: NodeSession
    history: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, hidden [1, T, D])

    def record(self, position: int, hidden: torch.Tensor) -> None:
        """Remember an input; inputs at or after ``position`` are forgotten first (the node rewinds the same way)."""
        kept = []
        for start, chunk in self.history:
            if start >= position:
                break
            kept.append((start, chunk[:, : position - start]))
        kept.append((position, hidden))
        self.history = kept


class ChainSession:
    """A session through every block: hidden states go in at block 0 and come out after the last block.

    When a node fails (dies, stalls past the step timeout, or refuses), only its block range is routed again, the new
    nodes are replayed the exact inputs the lost node had received, and the step goes on — the caller never notices
    beyond the delay. After ``max_failovers`` replacements in one session the last error is raised.
    """

    def __init__(
        self,
        p2p: P2P,
        router: Router,
        max_length: int,
        step_timeout: float,
        max_failovers: int = 5,
        links: StepLinks | None = None,
        push: bool = False,
    ) -> None:
        self._p2p = p2p
        self._links = links
        self.push = push and links is not None  # decode steps go node to node (needs the batch links)
        self._router = router
        self._max_length = max_length
        self._timeout = step_timeout
        self._failovers_left = max_failovers
        self._segments: list[Segment] = []
        self.failovers = 0
        self.closed = False

    @property
    def hops(self) -> list[Hop]:
        return [segment.session.hop for segment in self._segments]

    @property
    def max_length(self) -> int:
        return self._max_length

    async def resize(self, max_length: int) -> None:
        """Every node's room becomes ``max_length`` tokens, what they hold kept (a kept conversation's next turn).

        Raises the first node's error, leaving the chain unusable: the caller closes it (a fresh chain is cheaper to
        get right than a failover at a new length)."""
        self._check_open()
        self._max_length = max_length
        results = await asyncio.gather(
            *(segment.session.resize(max_length) for segment in self._segments), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def __aenter__(self) -> ChainSession:
        await self.open()
        return self

    async def open(self) -> None:
        """Route every block and open a session on each hop (failing over as steps do); closed again on failure."""
        try:
            hops = await self._router.route(self._max_length)
            self._segments = [Segment(self._new_session(hop)) for hop in hops]
            for before, segment in zip(self._segments, self._segments[1:], strict=False):
                segment.session.pusher = before.session.hop.peer_id
            for index, result in enumerate(
                await asyncio.gather(*(s.session.open() for s in self._segments), return_exceptions=True)
            ):
                if isinstance(result, BaseException):
                    await self._fail_over(self._segments[index], result)
        except BaseException:
            await self.close()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, T, D] embeddings of new tokens at position... -> [1, T, D] output of the last block."""
        self._check_open()
        chain_opened()  # the request's first step ends its queue time (later calls are no-ops)
        if self.push and hidden.shape[1] == 1 and len(self._segments) > 1:
            return await push_step(self, hidden, position)
        return await self.relay(hidden, position, 0)

    @property
    def segments(self) -> list[Segment]:
        return self._segments

    @property
    def router(self) -> Router:
        return self._router

    async def relay(self, hidden: torch.Tensor, position: int, index: int) -> torch.Tensor:
        """The step from segment ``index`` on, each hop's output sent on by the gateway (failing over as needed)."""
        while index < len(self._segments):
            segment = self._segments[index]
            try:
                output = await segment.session.step(hidden, position)
            except Exception as error:
                await self._fail_over(segment, error)
                continue  # the replacement now sits at the same index
            segment.record(position, hidden)
            self._router.record_success(segment.session.hop.peer_id)
            self._router.stats.relayed_hops += hidden.shape[1] == 1
            hidden = output
            index += 1
        return hidden

    async def close(self) -> None:
        # Shielded: a cancelled request must still release every node's cache room.
        self.closed = True
        sessions = [segment.session for segment in self._segments]
        self._router.release(s.hop for s in sessions)
        self._segments = []
        await asyncio.shield(asyncio.gather(*(s.close() for s in sessions), return_exceptions=True))

    def _check_open(self) -> None:
        if self.closed:  # with no segments left, a step would return its input unchanged
            raise NodeUnreachable("the chain session is closed")

    def _new_session(self, hop: Hop) -> NodeSession:
        return NodeSession(self._p2p, hop, self._max_length, self._timeout, self._router.auth, self._links)

    async def fail_over(self, failed: Segment, error: BaseException) -> None:
        await self._fail_over(failed, error)

    async def _fail_over(self, failed: Segment, error: BaseException) -> None:
        """Replace ``failed`` by new segments over the same blocks, replayed up to where it was."""
        culprit = failed
        while True:
            if not _recoverable(error) or self._failovers_left <= 0:
                raise error
            self._failovers_left -= 1
            self.failovers += 1
            self._router.stats.failovers += 1
            hop = culprit.session.hop
            logger.warning("node %s failed (%s); re-routing blocks %d:%d", hop.peer_id, error, hop.start, hop.end)
            self._router.record_failure(hop.peer_id)
            await self._drop(culprit)
            replacement, culprit_or_none, error_or_none = await self._build_replacement(failed)
            if culprit_or_none is None:
                index = self._segments.index(failed)
                self._segments[index : index + 1] = replacement
                await self._name_pusher(index + len(replacement))
                return
            culprit, error = culprit_or_none, error_or_none or error
            await asyncio.gather(*(self._drop(s) for s in replacement if s is not culprit))

    async def _build_replacement(self, failed: Segment) -> tuple[list[Segment], Segment | None, BaseException | None]:
        """New segments for ``failed``'s blocks with its history replayed; or the segment that failed and why."""
        hop = failed.session.hop
        hops = await self._router.route(self._max_length, hop.start, hop.end, fresh=True)
        segments = [Segment(self._new_session(h)) for h in hops]
        pusher = failed.session.pusher
        for segment in segments:
            segment.session.pusher, pusher = pusher, segment.session.hop.peer_id
        inputs = failed.history
        for segment in segments:
            try:
                await segment.session.open()
                outputs = await segment.session.replay(inputs)
                self._router.stats.record_replay(sum(chunk.shape[1] for _, chunk in inputs))
            except Exception as error:
                return segments, segment, error
            segment.history = inputs
            inputs = outputs
        return segments, None, None

    async def _name_pusher(self, index: int) -> None:
        """The hop after a replacement learns its new predecessor; if it cannot, this chain relays from now on."""
        if not self.push or not 0 < index < len(self._segments):
            return
        try:
            await self._segments[index].session.allow_push(self._segments[index - 1].session.hop.peer_id)
        except Exception as error:  # the step itself will find out whether the node is gone
            logger.info("no push into %s (%s); relaying", self._segments[index].session.hop.peer_id, error)
            self.push = False

    async def _drop(self, segment: Segment) -> None:
        self._router.release([segment.session.hop])
        with contextlib.suppress(Exception):
            await segment.session.close()


def _recoverable(error: BaseException) -> bool:
    if isinstance(error, NodeUnreachable | StepTimeout):
        return True
    return isinstance(error, RemoteError) and error.retryable
