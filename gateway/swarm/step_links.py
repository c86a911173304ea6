"""Decode steps of concurrent sessions to one node as one message: the gateway side of the node's batch handler.

The LM head scores the streams that step together as one batch and releases them together; each then sends its next
token's hidden state to the first node of its chain, and that node's replies send them on to the next. One message
per session costs B encodes, B trips through the p2p daemons and B decodes on each side, and each node's batcher
waits for the last of the B before it runs the forward. Here every step that reaches a node's link within one turn of
the event loop leaves in one ``BatchStep`` on one stream per node, and all come back in one reply: a node batch's rows
travel together from the head to the last node and back.

A row's failure is its own (the node names it); a broken or stalled stream — or a node that fails the liveness
watch (liveness.py) while rows wait on it — fails every row it carries, each of which then fails over like a failed
step on a session's own stream.

With node-to-node push a row may name the rest of its chain (the node pushes its output on), and the later nodes get
``pushed`` rows (no hidden states): each is answered with the input and output of its step once the push has run it.

Every reply signs its rows together (``shared.receipts``): it is checked once, against the step key the rows'
sessions were opened with, before any row is resolved; a reply that does not verify fails all its rows with
``BadReceipt``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from gateway.swarm.liveness import Liveness
from shared import step_trace
from shared.batching import Batcher, Job
from shared.errors import BadReceipt, MalformedReply, NodeUnreachable, SwarmError
from shared.receipts import Receipt, ReceiptCheck, check_receipts
from shared.rpc_client import decode_reply, over_transport
from shared.wire import (
    BATCH_HANDLER,
    MAX_BATCH_ROWS,
    BatchRow,
    BatchStep,
    BatchStepResult,
    NextHop,
    encode_request,
)


class RowReply(NamedTuple):
    input: torch.Tensor  # [1, 1, D] what the step ran on
    output: torch.Tensor  # [1, 1, D]
    receipt: Receipt  # the node's signed statement of it, verified


@dataclass
class _Row:
    receipts: ReceiptCheck  # the session's: its node's step key, the node's name for it, its blocks
    position: int
    hidden: torch.Tensor | None  # [1, 1, D]; None: pushed to the node by the previous one
    next: tuple[NextHop, ...] = ()  # where the node pushes the output on
    wait: float = 0.0  # a pushed row: seconds the node waits for the push
    stream: _Stream | None = None  # the stream it was sent on
    future: asyncio.Future[RowReply] = field(init=False)  # the batcher's, set when queued

    @property
    def session_id(self) -> str:
        return self.receipts.session_id


class _Stream:
    """One batch stream to a node: requests go out in order, replies come back in the same order."""

    def __init__(self, p2p: P2P, peer_id: str, timeout: float) -> None:
        self.peer_id = peer_id
        self._outbox: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self._sent: deque[list[_Row]] = deque()
        self._task = asyncio.create_task(self._serve(p2p, timeout))

    @property
    def alive(self) -> bool:
        return not self._task.done()

    def send(self, rows: list[_Row]) -> None:
        """Rows all pushed (no hidden states) or all with their hidden states."""
        batch_rows = [BatchRow(session_id=r.session_id, position=r.position, next=list(r.next)) for r in rows]
        inputs = [row.hidden for row in rows if row.hidden is not None]
        if len(inputs) == len(rows):
            request = encode_request(BatchStep(rows=batch_rows), (torch.cat(inputs),))
        else:
            request = encode_request(BatchStep(rows=batch_rows, pushed=True, wait=max(r.wait for r in rows)))
        self._sent.append(rows)
        for row in rows:
            step_trace.mark("gw-pushed-out" if row.hidden is None else "gw-step-out", row.session_id, row.position)
        self._outbox.put_nowait(request)

    def fail(self, error: Exception) -> None:
        """Give up on the stream: every row it carries fails with ``error``."""
        self._task.cancel()
        self._fail_sent(error)

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._fail_sent(NodeUnreachable(f"the batch stream to {self.peer_id} closed"))

    async def _serve(self, p2p: P2P, open_seconds: float) -> None:
        error: Exception = NodeUnreachable(f"node {self.peer_id} closed the batch stream")
        try:
            stream = p2p.iterate_protobuf_handler(
                PeerID.from_base58(self.peer_id), BATCH_HANDLER, self._requests(), runtime_pb2.ExpertResponse
            )
            replies = await over_transport(self.peer_id, "accept a batch stream", stream, open_seconds)
            while True:  # no limit here: each row's waiter watches its own deadline and the node's liveness
                response = await over_transport(self.peer_id, "answer a batch step", anext(replies), None)
                if not self._sent:
                    raise MalformedReply(f"node {self.peer_id} answered a batch step nobody sent")
                _answer(self._sent.popleft(), response, self.peer_id)
        except SwarmError as exc:
            error = exc
        finally:
            self._fail_sent(error)

    async def _requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while (request := await self._outbox.get()) is not None:
            yield request

    def _fail_sent(self, error: Exception) -> None:
        while self._sent:
            for row in self._sent.popleft():
                if not row.future.done():
                    row.future.set_exception(error)


def _answer(rows: list[_Row], response: runtime_pb2.ExpertResponse, peer_id: str) -> None:
    """Resolve each row from its reply: (its input, its output row, its receipt), or its own error."""
    pushed = rows[0].hidden is None
    try:
        reply, tensors = decode_reply(response, peer_id)
    except SwarmError as exc:  # the node's error for the whole batch, or garbage
        reply, tensors = None, []
        failure: Exception | None = exc
    else:
        failure = None
    if failure is None and not (
        isinstance(reply, BatchStepResult)
        and len(reply.errors) == len(rows)
        and len(tensors) == (2 if pushed else 1)
        and all(t.ndim == 3 and t.shape[0] == len(rows) for t in tensors)
    ):
        failure = MalformedReply(f"node {peer_id} sent a malformed batch reply")
    receipts: dict[int, Receipt] = {}
    if failure is None and isinstance(reply, BatchStepResult):
        try:
            receipts = _receipts(rows, reply, tensors)
        except BadReceipt as exc:
            failure = exc
    for index, row in enumerate(rows):
        step_trace.mark("gw-in", row.session_id, row.position)
        if row.future.done():  # the session gave up on this step (cancelled, timed out)
            continue
        if failure is not None:
            row.future.set_exception(failure)
        elif isinstance(reply, BatchStepResult) and (error := reply.errors[index]) is not None:
            row.future.set_exception(error.to_exception())
        else:
            row.future.set_result(RowReply(_input(row, tensors, index), tensors[0][index : index + 1], receipts[index]))


def _input(row: _Row, tensors: list[torch.Tensor], index: int) -> torch.Tensor:
    return tensors[1][index : index + 1] if row.hidden is None else row.hidden


def _receipts(rows: list[_Row], reply: BatchStepResult, tensors: list[torch.Tensor]) -> dict[int, Receipt]:
    """Each answered row's receipt, by row: the reply signs them together, so one signature check for all (rows
    go to one node process, whose step key every row's session was opened with)."""
    answered = [index for index, error in enumerate(reply.errors) if error is None]
    if not answered:
        return {}
    statements = [
        rows[i].receipts.statement(rows[i].position, _input(rows[i], tensors, i), tensors[0][i : i + 1])
        for i in answered
    ]
    first = rows[answered[0]].receipts
    return dict(zip(answered, check_receipts(first.key, first.signer, statements, reply.receipt), strict=True))


class StepLinks:
    """Batched decode steps to every node this gateway steps sessions on (one stream per node, opened on demand)."""

    def __init__(self, p2p: P2P, step_timeout: float, liveness: Liveness | None = None) -> None:
        self._p2p = p2p
        self._timeout = step_timeout
        self._liveness = liveness or Liveness(p2p)
        self._streams: dict[str, _Stream] = {}
        # Rows not sent yet, by node and kind (pushed or not). No rhythm: a link's worker sends, one turn of the loop
        # after the first row, every row queued by then (all the sessions the head released with it).
        self._batchers: dict[tuple[str, bool], Batcher[_Row, RowReply]] = {}
        self.messages = 0  # batch steps sent (tests, benchmarks)
        self.rows = 0  # session steps they carried

    async def step(
        self, receipts: ReceiptCheck, hidden: torch.Tensor, position: int, next: Sequence[NextHop] = ()
    ) -> RowReply:
        """One decode step of the node's session ``receipts.session_id`` on ``receipts.signer``: hidden [1, 1, D] at
        ``position`` -> its output row (checked by the caller) and its verified receipt; the node pushes the output
        on to ``next[0]`` too. Raises the node's typed error for this row, ``BadReceipt``, or
        ``NodeUnreachable``/``StepTimeout`` (then every row on its stream fails too: replies come in order,
        everything behind a lost one is lost)."""
        row = _Row(receipts, position, hidden, tuple(next))
        return await self._submit(receipts.signer, row, self._timeout)

    async def pushed(self, receipts: ReceiptCheck, position: int, wait: float) -> RowReply:
        """The step at ``position`` that the previous node pushes to the session; the node answers ``PushMissing``
        when no input came within ``wait`` seconds."""
        row = _Row(receipts, position, None, wait=wait)
        return await self._submit(receipts.signer, row, wait + self._timeout)

    async def _submit(self, peer_id: str, row: _Row, seconds: float) -> RowReply:
        key = (peer_id, row.hidden is None)
        batcher = self._batchers.get(key)
        if batcher is None:
            run = functools.partial(self._send, peer_id)
            batcher = self._batchers[key] = Batcher(run, name=f"step-link-{peer_id}", max_items=MAX_BATCH_ROWS)
        row.future = batcher.enqueue(row)
        try:  # cancelled or timed out, the wait cancels the row's future: its reply, when it comes, is dropped
            return await self._liveness.wait(peer_id, "answer a batch step", row.future, seconds)
        except SwarmError as error:
            if not row.future.done() or row.future.cancelled():  # not the row's own answer: a stall or a dead node
                self._abandon(peer_id, row.stream, error)
            raise

    def _abandon(self, peer_id: str, stream: _Stream | None, error: Exception) -> None:
        """Replies come in order: everything sent behind a lost one on ``stream`` is lost too, so fail it all now."""
        if stream is not None and self._streams.get(peer_id) is stream:
            del self._streams[peer_id]
            stream.fail(error)

    async def _send(self, peer_id: str, jobs: list[Job[_Row, RowReply]]) -> None:
        """Hand a run's rows (at most ``MAX_BATCH_ROWS``, callers that left already dropped) to the node's stream in
        one message: their replies settle them. Raising fails them all."""
        rows = [job.item for job in jobs]
        stream = self._streams.get(peer_id)
        if stream is None or not stream.alive:
            stream = self._streams[peer_id] = _Stream(self._p2p, peer_id, self._timeout)
        for row in rows:
            row.stream = stream
        try:
            stream.send(rows)
        except Exception as exc:  # never expected: fail the rows rather than leave them to the step timeout
            raise NodeUnreachable(f"cannot send a batch step to {peer_id}: {exc}") from exc
        self.messages += 1
        self.rows += len(rows)

    async def close(self) -> None:
        batchers, self._batchers = list(self._batchers.values()), {}
        await asyncio.gather(*(batcher.close() for batcher in batchers), return_exceptions=True)
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(stream.close() for stream in streams), return_exceptions=True)
