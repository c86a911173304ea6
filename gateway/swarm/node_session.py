"""A session on one remote node: one hivemind inference stream for blocks [hop.start, hop.end).

Requests go through a queue the stream reads; every reply is awaited under the step timeout and the liveness watch
(a dead or frozen node fails the wait in about a second, see liveness.py); transport failures and the node's own
errors come out typed (``shared.rpc_client``). Decode steps (one token) go through the gateway's ``StepLinks``
instead when it has them, batched with other sessions' steps to the same node; with push, the node sends a decode
step's output on to the next node itself (``next``), and a later node's step is awaited with ``pushed``. Every step's
output is used only once its receipt verifies against the step key the node certified at open (``shared.receipts``;
``last_receipt`` keeps the latest for spot checks). Closing is idempotent and always releases the node's cache room.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from pydantic import BaseModel

from gateway.swarm.liveness import Liveness
from gateway.swarm.routing import Hop
from gateway.swarm.step_links import StepLinks
from shared import wire
from shared.errors import BadReceipt, MalformedReply, NodeUnreachable
from shared.membership import CallAuth
from shared.receipts import Receipt, ReceiptCheck, verified_step_key
from shared.rpc_client import decode_reply, over_transport

T = TypeVar("T")
Reply = tuple[wire.ServerMessage, list[torch.Tensor]]

_CLOSED = None  # sentinel that ends the request stream
CLOSE_DRAIN = 5.0  # seconds a closed session's node has to end its stream before the gateway cuts it
_CLOSING: set[asyncio.Task[None]] = set()  # streams being drained (held: a task nobody references may vanish)


async def _drained(replies: AsyncIterator[runtime_pb2.ExpertResponse]) -> None:
    """Read what the node still sends until it ends the stream (it has closed the session then), then close."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_DRAIN):
            async for _ in replies:
                pass
    aclose = getattr(replies, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


@dataclass(frozen=True)
class TreeInput:
    """A tree step's input: hidden [1, T, D] at ``position``, ``parents`` as ``Step.tree`` names them."""

    position: int
    hidden: torch.Tensor
    parents: list[int]


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
        liveness: Liveness | None = None,
        adapter: str | None = None,
    ) -> None:
        self.hop = hop
        self.adapter = adapter
        self._links = links
        self._liveness = liveness
        self._session_id: str | None = None  # the node's name for it, once opened
        self._receipts: ReceiptCheck | None = None  # the step key the node certified at open, once opened
        self.last_receipt: Receipt | None = None  # the verified receipt of the latest step (spot checks keep it)
        self._stepped = False  # a step went out: later steps of a few tokens (verify steps) go by the step links
        self._auth = auth
        self.max_length = max_length
        self.pusher: str | None = None  # the node before this one, named at open: it may push steps here
        self._p2p = p2p
        self._timeout = step_timeout
        self._outbox: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self._replies: AsyncIterator[runtime_pb2.ExpertResponse] | None = None
        # Messages sent and not yet answered, oldest first: the node answers a stream's messages in order, so
        # several may be in flight (a replay, pipelined verify frames) and whoever waits reads replies for all.
        self._waiting: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self._reading = asyncio.Lock()
        self._broken: BaseException | None = None  # a read failed or was abandoned: later replies can't be matched
        self.closed = False

    async def open(self, alloc_timeout: float = 0.0) -> None:
        """Open the session; ``alloc_timeout``: seconds the node may wait for cache room before refusing."""
        stream = self._p2p.iterate_protobuf_handler(
            PeerID.from_base58(self.hop.peer_id),
            wire.INFERENCE_HANDLER,
            self._requests(),
            runtime_pb2.ExpertResponse,
        )
        self._replies = await over_transport(self.hop.peer_id, "accept a stream", stream, self._timeout)
        opened = wire.OpenSession(
            protocol=wire.PROTOCOL_VERSION,
            start=self.hop.start,
            end=self.hop.end,
            max_length=self.max_length,
            alloc_timeout=alloc_timeout,
            auth=self._auth.token_for(self.hop.peer_id) if self._auth else None,
            pusher=self.pusher,
            adapter=self.adapter,
        )
        reply, _ = await self._exchange(opened, extra_wait=alloc_timeout)
        if not isinstance(reply, wire.SessionOpened):
            raise MalformedReply(f"node {self.hop.peer_id} answered {reply.type!r} to open")
        key = verified_step_key(reply.step_key, self.hop.peer_id)  # one RSA check per session (~20 µs)
        self._session_id = reply.session_id
        self._receipts = ReceiptCheck(self.hop.peer_id, key, reply.session_id, (self.hop.start, self.hop.end))

    @property
    def next_hop(self) -> wire.NextHop | None:
        """How the node before this one names it in a push: None until opened (or without step links)."""
        if self._session_id is None or self._links is None or self.closed:
            return None
        return wire.NextHop(peer_id=self.hop.peer_id, session_id=self._session_id)

    async def step(
        self,
        hidden: torch.Tensor,
        position: int,
        next: list[wire.NextHop] | None = None,
        tree: list[int] | None = None,
        branch: list[int] | None = None,
    ) -> torch.Tensor:
        """hidden: [1, T, D] at positions position... -> the hop's output [1, T, D]; a decode step's output is also
        pushed along ``next`` (the rest of the chain). ``tree`` and ``branch`` as ``wire.Step`` has them. A later
        step of a few tokens (a speculative verify step) goes by the step links too, in one message and one forward
        with other sessions' decode steps; the session's first step (its prompt, or a replacement's replay), longer
        ones and tree steps (or a step naming a tree's branch) go on its own stream."""
        first, self._stepped = not self._stepped, True
        row = hidden.shape[1] == 1 or (not first and hidden.shape[1] <= wire.MAX_ROW_TOKENS)
        plain = tree is None and not branch
        if plain and row and self._links is not None and self._receipts is not None:
            self._check_usable()
            answer = await self._links.step(self._receipts, hidden, position, next or ())
            self.last_receipt = answer.receipt
            return self._checked_output(answer.output, hidden)
        reply, tensors = await self._exchange(wire.Step(position=position, tree=tree, branch=branch or None), (hidden,))
        return self._checked(reply, tensors, hidden, position)

    def _checked(
        self, reply: wire.ServerMessage, tensors: list[torch.Tensor], sent: torch.Tensor, position: int
    ) -> torch.Tensor:
        """The step's output, once its shape and values are those of an output and its receipt verifies."""
        if not isinstance(reply, wire.StepResult) or len(tensors) != 1:
            raise MalformedReply(f"node {self.hop.peer_id} sent a malformed step result")
        output = self._checked_output(tensors[0], sent)
        if self._receipts is None:
            raise BadReceipt(f"node {self.hop.peer_id} certified no step key")
        self.last_receipt = self._receipts.receipt(position, sent, output, reply.receipt)
        return output

    def _checked_output(self, output: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
        """The step's output if it is one: the shape and dtype of what was sent, every value finite. A node that
        answers anything else is broken (or lying): failing here bans it and routes around it, and none of its
        garbage reaches a sampled token."""
        if output.shape != sent.shape or output.dtype != sent.dtype:
            raise MalformedReply(
                f"node {self.hop.peer_id} sent {tuple(output.shape)} {output.dtype}"
                f" for {tuple(sent.shape)} {sent.dtype}"
            )
        if not bool(torch.isfinite(output).all()):
            raise MalformedReply(f"node {self.hop.peer_id} sent non-finite hidden states")
        return output

    async def pushed(self, position: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of the decode step at ``position`` pushed here by the previous node; ``like`` is the
        chain's input [1, 1, D], whose shape and dtype every hop keeps."""
        if self._links is None or self._receipts is None:
            raise NodeUnreachable(f"session on {self.hop.peer_id} is closed")
        self._check_usable()
        answer = await self._links.pushed(self._receipts, position, self._timeout, like.shape[1])
        self.last_receipt = answer.receipt
        return self._checked_output(answer.input, like), self._checked_output(answer.output, like)

    async def allow_push(self, pusher: str | None) -> None:
        """Let ``pusher`` (this hop's new predecessor) push steps into the session."""
        reply, _ = await self._exchange(wire.AllowPush(pusher=pusher))
        if not isinstance(reply, wire.PushAllowed):
            raise MalformedReply(f"node {self.hop.peer_id} sent a malformed allow-push reply")
        self.pusher = pusher

    async def resize(self, max_length: int) -> None:
        """Grow or shrink the node's room for this session; its stored tokens stay."""
        reply, _ = await self._exchange(wire.ResizeSession(max_length=max_length))
        if not isinstance(reply, wire.SessionResized) or reply.max_length != max_length:
            raise MalformedReply(f"node {self.hop.peer_id} sent a malformed resize reply")
        self.max_length = max_length

    async def truncate(self, length: int, branch: list[int] | None = None) -> None:
        """The node forgets its stored tokens from ``length`` on (refused past what it holds); ``branch``: a tree
        step's kept branch moves to the positions before ``length`` first (``wire.TruncateSession``)."""
        reply, _ = await self._exchange(wire.TruncateSession(length=length, branch=branch or None))
        if not isinstance(reply, wire.SessionTruncated) or reply.length != length:
            raise MalformedReply(f"node {self.hop.peer_id} sent a malformed truncate reply")

    async def replay(
        self, chunks: list[tuple[int, torch.Tensor]], tree: TreeInput | None = None
    ) -> list[tuple[int, torch.Tensor]]:
        """Send past inputs in their original chunks, pipelined (all sent, then all read): the node computes exactly
        what the lost node had, at one round trip's cost (``tree``: a tree step after them, sent last). Returns the
        outputs with their positions."""
        steps = [(wire.Step(position=position), hidden) for position, hidden in chunks]
        if tree is not None:
            steps.append((wire.Step(position=tree.position, tree=tree.parents), tree.hidden))
        sent = [(step.position, hidden, self._send(step, (hidden,))) for step, hidden in steps]
        outputs = []
        for position, hidden, future in sent:
            reply, tensors = await self._reply(future)
            outputs.append((position, self._checked(reply, tensors, hidden, position)))
        return outputs

    def send_step(self, hidden: torch.Tensor, position: int) -> Awaitable[torch.Tensor]:
        """Send a step on the session's own stream now -> its output [1, T, D] once answered (await it). Steps sent
        one after another reach the node in that order and it runs them in that order (a stream is served one
        message at a time), so a pipelined verify frame never arrives before the step it continues."""
        self._stepped = True
        future = self._send(wire.Step(position=position), (hidden,))
        return self._step_output(future, hidden, position)

    async def _step_output(self, future: asyncio.Future[Reply], hidden: torch.Tensor, position: int) -> torch.Tensor:
        reply, tensors = await self._reply(future)
        return self._checked(reply, tensors, hidden, position)

    async def close(self) -> None:
        """Ask the node to close the session and end the stream; the node's answers are drained in the background
        (up to ``CLOSE_DRAIN`` seconds) before the stream is torn down. Cutting the stream at once instead left the
        node's handler cancelled wherever it was: cancelled while it sent a reply, its session was freed only when
        the garbage collector got to it."""
        if self.closed:
            return
        self.closed = True
        self._outbox.put_nowait(wire.encode_request(wire.CloseSession()))
        self._outbox.put_nowait(_CLOSED)
        if self._replies is not None:
            task = asyncio.create_task(_drained(self._replies))
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)

    async def _requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while (request := await self._outbox.get()) is not _CLOSED:
            yield request

    async def _exchange(
        self, message: BaseModel, tensors: tuple[torch.Tensor, ...] = (), extra_wait: float = 0.0
    ) -> Reply:
        return await self._reply(self._send(message, tensors), extra_wait)

    def _check_usable(self) -> None:
        """Raises ``NodeUnreachable`` once the session is closed or its stream broke. A broken stream (a read that
        failed: a pipelined frame found the node gone or frozen) ends the session for the step links too: a step
        sent there would wait out the liveness watch on the same node again, and the session could never be
        rewound, resized or closed, so the step fails over at once."""
        if self.closed:
            raise NodeUnreachable(f"session on {self.hop.peer_id} is closed")
        if self._broken is not None:
            raise NodeUnreachable(f"session on {self.hop.peer_id} lost its stream: {self._broken}")

    def _send(self, message: BaseModel, tensors: tuple[torch.Tensor, ...] = ()) -> asyncio.Future[Reply]:
        """Put a message on the stream now -> the future of its reply (``_reply`` reads it)."""
        if self._replies is None:
            raise NodeUnreachable(f"session on {self.hop.peer_id} is closed")
        self._check_usable()
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self._waiting.append(future)
        self._outbox.put_nowait(wire.encode_request(message, tensors))
        return future

    async def _reply(self, future: asyncio.Future[Reply], extra_wait: float = 0.0) -> Reply:
        """The reply to a sent message: replies come in the order the messages went, so the reader reads (and hands
        out) every earlier one first. A failed or abandoned read fails every message still waiting; a refusal (the
        node answered with a typed error: a truncate past what it holds) fails its own message only, and the stream
        stays in step."""
        async with self._reading:
            while not future.done():
                head = self._waiting.popleft()
                try:
                    response = await self._receive(extra_wait)
                except BaseException as error:
                    self._fail_waiting(head, error)
                    raise
                try:
                    head.set_result(decode_reply(response, self.hop.peer_id))
                except Exception as refusal:  # noqa: BLE001 - handed to the message's own waiter
                    head.set_exception(refusal)
        return future.result()

    def _fail_waiting(self, head: asyncio.Future[Reply], error: BaseException) -> None:
        """The stream can no longer be read in step with its messages: whatever still waits fails as unreachable."""
        self._broken = error
        lost = NodeUnreachable(f"session on {self.hop.peer_id} lost its stream: {error!r}")
        for future in [head, *self._waiting]:
            if not future.done():
                future.set_exception(error if isinstance(error, Exception) else lost)
        self._waiting.clear()

    async def _receive(self, extra_wait: float = 0.0) -> runtime_pb2.ExpertResponse:
        if self._replies is None:
            raise NodeUnreachable(f"session on {self.hop.peer_id} is not open")
        return await self._watched("answer", anext(self._replies), self._timeout + extra_wait)

    async def _watched(self, what: str, work: Awaitable[T], limit: float) -> T:
        if self._liveness is None:
            return await over_transport(self.hop.peer_id, what, work, limit)
        return await self._liveness.wait(self.hop.peer_id, what, work, limit)


def _retrieve(future: asyncio.Future[Reply]) -> None:
    """A reply nobody waits for any more (its frame was voided) fails quietly, never as an unretrieved error."""
    if not future.cancelled():
        future.exception()
