"""The node's RPC handlers: inference sessions (stream), batched decode steps of those sessions (stream), pushes from
the previous node of a chain (stream, ``swarm_node.push``), stateless forward (unary) and info (unary).

Every request is validated explicitly; a bad one gets a typed ``ErrorReply`` and the node (and, for a session, the
stream) keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from shared import step_trace
from shared.background import Periodic
from shared.dht_records import NodeState
from shared.errors import (
    BadRequest,
    NodeDraining,
    NodeInternalError,
    PositionOutOfRange,
    RemoteError,
    UnknownSession,
    WrongSpan,
)
from shared.kv_charge import pool_tokens
from shared.membership import ReplayGuard
from shared.receipts import StepKey, StepKeyCertificate, StepStatement
from shared.wire import (
    BATCH_HANDLER,
    FORWARD_HANDLER,
    INFERENCE_HANDLER,
    INFO_HANDLER,
    PROTOCOL_VERSION,
    PUSH_HANDLER,
    AllowPush,
    BatchRow,
    BatchStepResult,
    CloseSession,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    InfoRequest,
    NodeInfo,
    OpenSession,
    PushAccepted,
    PushAllowed,
    ResizeSession,
    SessionOpened,
    SessionResized,
    SessionTruncated,
    Step,
    StepResult,
    TruncateSession,
    decode_batch_step,
    decode_client_message,
    decode_push_step,
    decode_unary,
    encode_response,
)
from shared.wire import ClientMessage as SessionMessage
from swarm_node.backend import SpanBackend
from swarm_node.cache_pool import CachePool
from swarm_node.fair_share import FairShare, ShareLimits
from swarm_node.faults import lie_about
from swarm_node.kv_cache import SessionKV, check_branch, is_chain, tree_depths
from swarm_node.push import PushLinks, RowsOutcome, run_rows, wait_rows
from swarm_node.rpc_checks import check_batch, check_blocks, check_hidden, check_max_length, check_protocol
from swarm_node.sessions import Session, SessionRegistry
from swarm_node.stream_replies import in_order

logger = logging.getLogger(__name__)


@dataclass
class NodeStatus:
    """What the handlers need to know about the node beyond its span."""

    model: str
    version: str
    max_session_length: int
    state: NodeState = NodeState.JOINING
    added_latency: float = 0.0  # seconds slept before every reply: emulates a distant node (tests, demos)
    faulty_outputs: str = "none"  # testing: "nan", "shape" or "dtype" corrupts every step's reply (others: faults.py)
    session_idle_timeout: float = 300.0  # seconds a session may sit without a step before its room is taken back
    peer_id: str = ""  # this node's own peer id (call tokens name it)
    guard: ReplayGuard | None = None  # a private swarm's call-token check; None: a public swarm
    share_limits: ShareLimits = field(default_factory=ShareLimits)  # what one peer may hold while others use us
    step_key: StepKey | None = None  # certified to gateways at every open (shared.receipts); set once joined
    signer: StepKey | None = None  # signs every step reply's receipt: the step key (but for a bad-receipt test node)


class SpanHandlers:
    def __init__(self, backend: SpanBackend, pool: CachePool, status: NodeStatus) -> None:
        self.backend = backend
        self.pool = pool
        self.status = status
        self.sessions = SessionRegistry(status.session_idle_timeout)
        self.fair = FairShare(status.share_limits, pool.total_tokens, self.sessions.holdings)
        self.start, self.end = backend.span.start, backend.span.end
        self.hidden_size = backend.span.hidden_size
        self.tokens_processed = 0  # tokens through the span (steps and forwards): shows what a gateway saved
        self._expiry = Periodic("session-expiry", self.sessions.expiry_period, self.sessions.expire)
        self.push_links: PushLinks | None = None  # streams to the next nodes of chains, once registered

    def use_backend(self, backend: SpanBackend) -> None:
        """Serve another span (after the node moved); the caller drained every session first."""
        self.backend = backend
        self.start, self.end = backend.span.start, backend.span.end

    async def register(self, p2p: P2P) -> None:
        """Serve the RPCs on ``p2p``, and start expiring idle sessions."""
        await p2p.add_protobuf_handler(
            INFERENCE_HANDLER, self.inference, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
        )
        await p2p.add_protobuf_handler(
            BATCH_HANDLER, self.batch, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
        )
        await p2p.add_protobuf_handler(
            PUSH_HANDLER, self.push, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
        )
        if self.push_links is None:
            own = p2p.peer_id.to_base58()
            self.push_links = PushLinks(p2p, lambda request: self._push_reply(request, own))
        for handler, what, work in ((FORWARD_HANDLER, "forward", self._forward), (INFO_HANDLER, "info", self._info)):
            await p2p.add_protobuf_handler(handler, self._unary(what, work), runtime_pb2.ExpertRequest)
        self._expiry.start()

    def shutdown(self) -> None:
        """Stop expiring sessions and stop the compute thread."""
        self._expiry.cancel()
        if self.push_links is not None:
            self.push_links.stop()
        self.backend.shutdown()

    async def inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One session per stream: opened by its first message, then steps and edits; each reply in order."""
        stream = _SessionStream(self, context)
        # hivemind runs this generator in one task per stream; when the caller cuts the stream it cancels that task,
        # and cancelled while it sends a reply, the task ends with this generator suspended at its ``yield``: the
        # ``finally`` below would run only once the garbage collector finalizes it. The task's end frees the room.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: self._close_stream_session(stream))
        try:
            async for request in requests:
                await self._emulate_distance()
                reply = await _replying("inference step", functools.partial(stream.answer, request))
                if reply is None:  # the client closed the session
                    return
                yield reply
        finally:  # the stream closed, ended or was cancelled: its session's room goes back to the pool
            self._close_stream_session(stream)

    def _close_stream_session(self, stream: _SessionStream) -> None:
        if stream.session is not None:
            self.sessions.close(stream.session)  # idempotent: the stream's own end may have closed it already

    async def batch(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Batched decode steps of the caller's own sessions (rows may push on, or wait for a push); replies in
        request order."""
        owner = context.remote_id.to_base58()
        async for reply in in_order(requests, lambda request: self._batch_reply(request, owner)):
            yield reply

    async def push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Steps pushed by the previous node of a chain (or the opener): each row runs once its session allows the
        sender; the reply says which rows ran (the sender only logs it: the gateway hears of every step anyway)."""
        pusher = context.remote_id.to_base58()
        async for reply in in_order(requests, lambda request: self._push_reply(request, pusher)):
            yield reply

    async def _batch_reply(self, request: runtime_pb2.ExpertRequest, owner: str) -> runtime_pb2.ExpertResponse:
        await self._emulate_distance()
        return await _replying("batched step", lambda: self._batch_step(request, owner))

    async def _batch_step(self, request: runtime_pb2.ExpertRequest, owner: str) -> runtime_pb2.ExpertResponse:
        message, tensors = decode_batch_step(request)
        _mark_rows("node-pushed-in" if message.pushed else "node-step-in", message.rows)
        sessions = self._row_sessions(message.rows, lambda session_id: self.sessions.owned(session_id, owner))
        if message.pushed:
            if tensors:
                raise BadRequest("a pushed batch step carries no hidden states")
            outcome = await wait_rows(message.rows, sessions, message.wait, self.hidden_size)
            outputs: tuple[torch.Tensor, ...] = (self._corrupt(outcome.outputs), outcome.inputs)
        else:
            outcome = await self._run_rows(message.rows, check_batch(message, tensors, self.hidden_size), sessions)
            outputs = (self._corrupt(outcome.outputs),)
        statements = [  # each row's own positions: shorter rows are right-padded to the longest
            StepStatement.of(
                row.session_id,
                row.position,
                session.blocks,
                outcome.inputs[b : b + 1, : row.tokens],
                outputs[0][b : b + 1, : row.tokens],
            )
            for b, (row, session, error) in enumerate(zip(message.rows, sessions, outcome.errors, strict=True))
            if error is None and isinstance(session, Session)
        ]
        _mark_rows("node-answer", message.rows)
        return encode_response(BatchStepResult(errors=outcome.errors, receipt=self.receipt(statements)), outputs)

    async def _push_reply(self, request: runtime_pb2.ExpertRequest, pusher: str) -> runtime_pb2.ExpertResponse:
        await self._emulate_distance()
        return await _replying("pushed step", lambda: self._pushed_step(request, pusher))

    async def _pushed_step(self, request: runtime_pb2.ExpertRequest, pusher: str) -> runtime_pb2.ExpertResponse:
        message, tensors = decode_push_step(request)
        _mark_rows("node-push-in", message.rows)
        sessions = self._row_sessions(message.rows, lambda session_id: self.sessions.pushable(session_id, pusher))
        hidden = check_batch(message, tensors, self.hidden_size)
        outcome = await self._run_rows(message.rows, hidden, sessions, pushed=True)
        return encode_response(PushAccepted(errors=outcome.errors))

    async def _run_rows(
        self, rows: list[BatchRow], hidden: torch.Tensor, sessions: list[Session | RemoteError], pushed: bool = False
    ) -> RowsOutcome:
        if self.push_links is None:
            raise NodeInternalError("the node is not serving yet")

        async def step(session: Session, row: torch.Tensor, position: int) -> torch.Tensor:
            return await self._step(session, Step(position=position), [row], decode=True)

        return await run_rows(rows, hidden, sessions, step, self.push_links, pushed)

    @staticmethod
    def _row_sessions(rows: list[BatchRow], find: Callable[[str], Session]) -> list[Session | RemoteError]:
        """Each row's session, or the typed error that row gets (the other rows still run)."""
        found: list[Session | RemoteError] = []
        for row in rows:
            try:
                found.append(find(row.session_id))
            except RemoteError as error:
                found.append(error)
        return found

    async def _open(self, message: OpenSession, owner: str) -> Session:
        check_protocol(message.protocol)
        blocks = check_blocks(message.start, message.end, self.span_blocks)
        if self.status.state is not NodeState.ONLINE:
            raise NodeDraining(f"node is {self.status.state.value}; it accepts no new sessions")
        check_max_length(message.max_length, self.status.max_session_length)
        self._check_adapter(message.adapter)
        charge = pool_tokens(message.max_length, len(blocks), len(self.span_blocks))  # its blocks' share of the pool
        self.fair.check_room(owner, charge, new_session=True)
        with self.fair.waiting(owner):  # while it waits for room, peers over their share take no more
            allocation = await self.pool.allocate(charge, message.alloc_timeout)
        try:
            kv = await self.backend.new_session_kv(blocks, message.max_length, message.adapter)
        except BaseException:  # cancelled or failed before the session exists: nobody else would release the room
            allocation.release()
            raise
        session = self.sessions.add(kv, allocation, owner)
        session.pusher = message.pusher
        logger.debug("session %s opened for blocks %d:%d", session.session_id, blocks.start, blocks.stop)
        return session

    async def _resize(self, session: Session, message: ResizeSession) -> None:
        """Grow or shrink the session's room, its stored tokens kept; the pool grants growth like an open."""
        if message.max_length > session.max_length and self.status.state is not NodeState.ONLINE:
            raise NodeDraining(f"node is {self.status.state.value}; sessions may not grow")
        check_max_length(message.max_length, self.status.max_session_length)
        with self.sessions.active(session) as kv:  # busy: the idle reaper leaves it alone while it waits for room
            if message.max_length < kv.length:
                raise PositionOutOfRange(f"max_length {message.max_length} is below the {kv.length} stored tokens")
            if message.max_length == kv.max_length:
                return
            growing = message.max_length > kv.max_length
            charge = pool_tokens(message.max_length, kv.num_layers, len(self.span_blocks))
            if growing:  # room first: the tensors grow only once the pool has granted it
                self.fair.check_room(session.owner, charge - session.allocation.tokens, new_session=False)
                await self.pool.resize(session.allocation, charge, message.alloc_timeout)
            await self.backend.resize_session_kv(kv, message.max_length)
            if not growing:  # the old, larger tensors are gone now
                await self.pool.resize(session.allocation, charge)
            session.max_length = message.max_length

    def _truncate(self, session: Session, length: int, branch: list[int] | None = None) -> None:
        """Forget the session's stored tokens from ``length`` on; its room in the pool stays as it is. With
        ``branch``, its last ``len(branch)`` positions take the stored tokens at those slots (a tree's kept branch)."""
        with self.sessions.active(session) as kv:
            if length > kv.length:
                raise PositionOutOfRange(f"cannot truncate to {length}: the session holds {kv.length} tokens")
            session.slots.clear()  # the latest decode step may be among the forgotten tokens
            if branch:
                _keep_branch(kv, length, branch)
            kv.length = length

    async def _step(
        self, session: Session, message: Step, tensors: list[torch.Tensor], decode: bool = False
    ) -> torch.Tensor:
        """``decode``: a row of a batch step, batched with other sessions' decode steps (``SpanBackend.serve_step``)."""
        if not isinstance(message, Step):
            raise BadRequest(f"unexpected message {message.type!r} in an open session")
        hidden = check_hidden(tensors, self.hidden_size, batch=1)
        new_tokens = hidden.shape[1]
        parents = _checked_tree(message.tree, new_tokens)
        with self.sessions.active(session) as kv:
            if message.branch:
                _keep_branch(kv, message.position, message.branch)
            if message.position > kv.length:
                raise PositionOutOfRange(
                    f"position {message.position} leaves a gap after the session's {kv.length} tokens"
                )
            if message.position + new_tokens > kv.max_length:
                raise PositionOutOfRange(
                    f"positions up to {message.position + new_tokens} exceed max_length {kv.max_length}"
                )
            with self.fair.step(session.owner):
                output = await self.backend.serve_step(kv, hidden, message.position, parents, decode=decode)
        self.tokens_processed += new_tokens
        return output

    def _unary(self, what: str, work: _UnaryWork) -> _UnaryWork:
        """A unary RPC's handler: ``work``'s reply, any error as its ``ErrorReply`` (``_replying``)."""

        async def handle(request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
            await self._emulate_distance()
            return await _replying(what, functools.partial(work, request, context))

        return handle

    async def _forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        message, tensors = decode_unary(request, ForwardRequest)
        self._authorize(message.auth, context)
        check_protocol(message.protocol)
        blocks = check_blocks(message.start, message.end, self.span_blocks)
        hidden = check_hidden(tensors, self.hidden_size, batch=None)
        if hidden.shape[1] > self.status.max_session_length:
            raise PositionOutOfRange(f"{hidden.shape[1]} tokens exceed {self.status.max_session_length}")
        self._check_adapter(message.adapter)
        async with self.pool.reserve(hidden.shape[0] * hidden.shape[1]):
            output = await self.backend.forward(hidden, blocks, message.adapter)
        self.tokens_processed += hidden.shape[0] * hidden.shape[1]
        if self.status.faulty_outputs == "forward-shape":  # testing: a liar only where it serves as a reference
            output = self._corrupt(output, "shape")
        elif self.status.faulty_outputs == "forward-noise":  # ... the same, with plausible wrong values
            output = lie_about("noise", hidden, output)
        return encode_response(ForwardResult(), (output,))

    async def _info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        message, _ = decode_unary(request, InfoRequest)
        self._authorize(message.auth, context)
        return encode_response(self.node_info())

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.backend.span.adapters:
            # Like blocks it does not serve: the router read a record that is out of date, or never listed it.
            raise WrongSpan(f"this node serves no adapter {adapter!r}")

    def _authorize(self, token: str | None, context: P2PContext) -> None:
        if self.status.guard is not None:
            self.status.guard.check(token, context.remote_id.to_base58(), self.status.peer_id)

    def receipt(self, statements: list[StepStatement]) -> str:
        """The signature of a reply's steps (``shared.receipts``): one per reply (cost: bench/receipts.py)."""
        if self.status.signer is None:
            raise NodeInternalError("the node has no step key yet")
        return self.status.signer.sign(statements)

    def step_key_certificate(self) -> StepKeyCertificate:
        if self.status.step_key is None:
            raise NodeInternalError("the node has no step key yet")
        return self.status.step_key.certificate

    def _corrupt(self, output: torch.Tensor, fault: str | None = None) -> torch.Tensor:
        """A broken node, for tests of the gateway's checks (``--faulty-outputs``, or ``fault`` where given); a
        healthy node returns as is."""
        fault = self.status.faulty_outputs if fault is None else fault
        if fault == "nan":
            return torch.full_like(output, float("nan"))
        if fault == "shape":
            return output[:, :, : output.shape[-1] // 2]
        if fault == "dtype":
            return output.to(torch.float16)
        return output

    async def _emulate_distance(self) -> None:
        if self.status.added_latency > 0:
            await asyncio.sleep(self.status.added_latency)

    def node_info(self) -> NodeInfo:
        return NodeInfo(
            model=self.status.model,
            start=self.start,
            end=self.end,
            state=self.status.state.value,
            protocol=PROTOCOL_VERSION,
            version=self.status.version,
            dtype=str(self.backend.dtype).removeprefix("torch."),
            cache_tokens_total=self.pool.total_tokens,
            cache_tokens_left=self.pool.tokens_left,
            sessions=self.pool.sessions,
            tokens_processed=self.tokens_processed,
        )

    @property
    def span_blocks(self) -> range:
        return range(self.start, self.end)


def _keep_branch(kv: SessionKV, end: int, branch: list[int]) -> None:
    """The stored tokens at ``branch``'s slots become the positions before ``end`` (a tree step's kept branch)."""
    start = end - len(branch)
    refusal = check_branch(kv.length, start, branch)
    if refusal is not None:
        raise PositionOutOfRange(refusal)
    kv.keep_branch(start, branch)


def _checked_tree(parents: list[int] | None, new_tokens: int) -> list[int] | None:
    """A tree step's parents, if they lay out its ``new_tokens`` tokens as a tree; None for a chain."""
    if parents is None or is_chain(parents):
        return None
    if len(parents) != new_tokens:
        raise BadRequest(f"a tree of {len(parents)} tokens for a step of {new_tokens}")
    try:
        tree_depths(parents)
    except ValueError as error:
        raise BadRequest(str(error)) from None
    return parents


def _mark_rows(stage: str, rows: list[BatchRow]) -> None:
    for row in rows:
        step_trace.mark(stage, row.session_id, row.position)


_UnaryWork = Callable[[runtime_pb2.ExpertRequest, P2PContext], Awaitable[runtime_pb2.ExpertResponse]]
_Reply = TypeVar("_Reply", runtime_pb2.ExpertResponse, runtime_pb2.ExpertResponse | None)


async def _replying(what: str, work: Callable[[], Awaitable[_Reply]]) -> _Reply | runtime_pb2.ExpertResponse:
    """``work``'s reply; a typed error becomes its ``ErrorReply`` and anything else an internal error, logged once
    (the stream, and the node, go on serving)."""
    try:
        return await work()
    except RemoteError as error:
        return encode_response(ErrorReply.of(error))
    except Exception:
        logger.exception("%s failed", what)
        return encode_response(ErrorReply.of(NodeInternalError("internal error on the node")))


class _SessionStream:
    """The messages of one inference stream, dispatched by type: the first opens the session, later ones step or
    edit it, ``CloseSession`` ends the stream (``answer`` returns None)."""

    def __init__(self, handlers: SpanHandlers, context: P2PContext) -> None:
        self.handlers = handlers
        self.context = context
        self.session: Session | None = None

    async def answer(self, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse | None:
        message, tensors = decode_client_message(request)
        if isinstance(message, CloseSession):
            return None
        if isinstance(message, OpenSession):
            return await self._open(message)
        if self.session is None:
            raise UnknownSession("step before the session was opened")
        return await self._edit_or_step(self.session, message, tensors)

    async def _open(self, message: OpenSession) -> runtime_pb2.ExpertResponse:
        if self.session is not None:
            raise BadRequest("this stream already has an open session")
        self.handlers._authorize(message.auth, self.context)
        session = self.session = await self.handlers._open(message, self.context.remote_id.to_base58())
        return encode_response(
            SessionOpened(
                session_id=session.session_id,
                start=session.first_block,
                end=session.end_block,
                max_length=session.max_length,
                step_key=self.handlers.step_key_certificate(),
            )
        )

    async def _edit_or_step(
        self, session: Session, message: SessionMessage, tensors: list[torch.Tensor]
    ) -> runtime_pb2.ExpertResponse:
        handlers = self.handlers
        match message:
            case ResizeSession():
                await handlers._resize(session, message)
                return encode_response(SessionResized(max_length=session.max_length))
            case TruncateSession():
                handlers._truncate(session, message.length, message.branch)
                return encode_response(SessionTruncated(length=message.length))
            case AllowPush():
                session.pusher = message.pusher
                return encode_response(PushAllowed())
            case Step():
                session.slots.clear()  # this step may rewrite what the latest decode step ran on
                output = handlers._corrupt(await handlers._step(session, message, tensors))
                done = StepStatement.of(session.session_id, message.position, session.blocks, tensors[0], output)
                return encode_response(
                    StepResult(position=message.position, receipt=handlers.receipt([done])), (output,)
                )
        raise BadRequest(f"unexpected message {message.type!r} in an open session")
