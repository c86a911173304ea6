"""Decode steps of concurrent sessions to one node as one message: the gateway side of the node's batch handler.

The LM head scores the streams that step together as one batch and releases them together; each then sends its next
token's hidden state to the first node of its chain, and that node's replies send them on to the next. One message
per session costs B encodes, B trips through the p2p daemons and B decodes on each side, and each node's batcher
waits for the last of the B before it runs the forward. Here every step that reaches a node's link within one turn of
the event loop leaves in one ``BatchStep`` on one stream per node, and all come back in one reply: a node batch's rows
travel together from the head to the last node and back.

A row's failure is its own (the node names it); a broken or stalled stream fails every row it carries, each of which
then fails over like a failed step on a session's own stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from shared.batching import Batcher, Job
from shared.errors import NodeUnreachable, RemoteError, StepTimeout
from shared.protocol import (
    BATCH_HANDLER,
    MAX_BATCH_ROWS,
    BatchRow,
    BatchStep,
    BatchStepResult,
    ErrorReply,
    decode_server_message,
    encode_request,
)


@dataclass
class _Step:
    session_id: str
    position: int
    hidden: torch.Tensor  # [1, 1, D]


_Row = Job[_Step, torch.Tensor]  # a step and its caller's future


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
        steps = [row.item for row in rows]
        message = BatchStep(rows=[BatchRow(session_id=step.session_id, position=step.position) for step in steps])
        request = encode_request(message, (torch.cat([step.hidden for step in steps]),))
        self._sent.append(rows)
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
            replies = await asyncio.wait_for(
                p2p.iterate_protobuf_handler(
                    PeerID.from_base58(self.peer_id), BATCH_HANDLER, self._requests(), runtime_pb2.ExpertResponse
                ),
                open_seconds,
            )
            async for response in replies:
                if not self._sent:
                    raise NodeUnreachable(f"node {self.peer_id} answered a batch step nobody sent")
                _answer(self._sent.popleft(), response, self.peer_id)
        except TimeoutError:
            error = StepTimeout(f"node {self.peer_id} did not accept a batch stream in {open_seconds}s")
        except NodeUnreachable as exc:
            error = exc
        except Exception as exc:
            error = NodeUnreachable(f"lost node {self.peer_id}: {exc}")
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
    """Resolve each row from its reply: its output row, or its own error."""
    try:
        reply, tensors = decode_server_message(response)
    except RemoteError as exc:
        reply, tensors = None, []
        failure: Exception | None = NodeUnreachable(f"node {peer_id} sent an unreadable batch reply: {exc}")
    else:
        failure = None
    if isinstance(reply, ErrorReply):
        failure = reply.to_exception()
    elif failure is None and not (
        isinstance(reply, BatchStepResult)
        and len(reply.errors) == len(rows)
        and len(tensors) == 1
        and tensors[0].ndim == 3
        and tensors[0].shape[0] == len(rows)
    ):
        failure = NodeUnreachable(f"node {peer_id} sent a malformed batch reply")
    for index, row in enumerate(rows):
        if row.future.done():  # the session gave up on this step (cancelled, timed out)
            continue
        if failure is not None:
            row.future.set_exception(failure)
        elif isinstance(reply, BatchStepResult) and (error := reply.errors[index]) is not None:
            row.future.set_exception(error.to_exception())
        else:
            row.future.set_result(tensors[0][index : index + 1])


class StepLinks:
    """Batched decode steps to every node this gateway steps sessions on (one stream per node, opened on demand)."""

    def __init__(self, p2p: P2P, step_timeout: float) -> None:
        self._p2p = p2p
        self._timeout = step_timeout
        self._streams: dict[str, _Stream] = {}
        self._batchers: dict[str, Batcher[_Step, torch.Tensor]] = {}  # rows not sent yet, by node
        self.messages = 0  # batch steps sent (tests, benchmarks)
        self.rows = 0  # session steps they carried

    async def step(self, peer_id: str, session_id: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """One decode step of the node's session ``session_id``: hidden [1, 1, D] at ``position`` -> its output row
        (checked by the caller). Raises the node's typed error for this row, or ``NodeUnreachable``/``StepTimeout``."""
        batcher = self._batchers.get(peer_id)
        if batcher is None:  # no rhythm: its worker sends, one turn of the loop after the first row, every row queued
            run = functools.partial(self._send, peer_id)  # by then: all the sessions released with it
            batcher = self._batchers[peer_id] = Batcher(run, name=f"step-link-{peer_id}")
        future = batcher.enqueue(_Step(session_id, position, hidden))
        try:  # cancelled or timed out, wait_for cancels the row's future: its reply, when it comes, is dropped
            return await asyncio.wait_for(future, self._timeout)
        except TimeoutError:
            stream = self._streams.pop(peer_id, None)
            if stream is not None:  # replies come in order: everything behind the stalled one is stuck too
                stream.fail(StepTimeout(f"node {peer_id} did not answer a batch step within {self._timeout}s"))
            raise StepTimeout(f"node {peer_id} did not answer within {self._timeout}s") from None

    async def _send(self, peer_id: str, rows: list[_Row]) -> None:
        """Hand the rows to the node's stream: their replies settle them."""
        stream = self._streams.get(peer_id)
        if stream is None or not stream.alive:
            stream = self._streams[peer_id] = _Stream(self._p2p, peer_id, self._timeout)
        for first in range(0, len(rows), MAX_BATCH_ROWS):
            chunk = rows[first : first + MAX_BATCH_ROWS]
            try:
                stream.send(chunk)
            except Exception as exc:  # never expected: fail the rows rather than leave them to the step timeout
                for row in chunk:
                    row.fail(NodeUnreachable(f"cannot send a batch step to {peer_id}: {exc}"))
                continue
            self.messages += 1
            self.rows += len(chunk)

    async def close(self) -> None:
        for batcher in self._batchers.values():
            batcher.stop()
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(stream.close() for stream in streams), return_exceptions=True)
