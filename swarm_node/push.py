"""Node-to-node push: rows of decode steps run through their sessions' step slots, and outputs go on to the next node.

A row of a batch step (from the gateway) or of a push (from the previous node) may name the rest of its chain. Once
the row has run here, its output goes to the next node in one ``PushStep`` per next node — a batch that arrived
together leaves together — on one long-lived stream per next node (``PushLinks``), fire and forget: the gateway gets
every output anyway and relays a step whose push went missing.

    gateway ──BatchStep(rows, next=[B, C])──▶ A ──PushStep(next=[C])──▶ B ──PushStep──▶ C
        ▲  ◀──────── outputs ──────────────────┘            │                           │
        └──────────────── outputs + inputs (pushed rows) ───┴───────────────────────────┘
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from shared import step_trace
from shared.errors import NodeInternalError, RemoteError
from shared.wire import (
    PUSH_HANDLER,
    BatchRow,
    ErrorReply,
    PushAccepted,
    PushStep,
    decode_server_message,
    encode_request,
    right_padded,
)
from swarm_node.sessions import Session

logger = logging.getLogger(__name__)

# Runs one session's step: (session, hidden [1, T, D], position) -> output [1, T, D].
StepFn = Callable[[Session, torch.Tensor, int], Awaitable[torch.Tensor]]


@dataclass
class RowsOutcome:
    outputs: torch.Tensor  # [B, T, D], each row right-padded to the longest; a failed row is zeros
    inputs: torch.Tensor  # [B, T, D]: what each row ran on
    errors: list[ErrorReply | None]


class PushLinks:
    """One push stream to each next node, opened on first use; a broken one is dropped and reopened on next use.

    The next node may be this one: a failover can patch a lost range with a hop on the node that serves the next
    one (a chain ... X[14:15), X[15:18) ...). libp2p refuses to dial itself, so such a push is handed to this
    node's own push handler (``local``) instead: before, every step of those chains waited for the gateway to
    relay it (48 tokens in 8-13 minutes in a 24-node churn run)."""

    def __init__(self, p2p: P2P, local: Callable[[runtime_pb2.ExpertRequest], Awaitable[Any]] | None = None) -> None:
        self._p2p = p2p
        self._own = p2p.peer_id.to_base58() if local is not None else None
        self._local = local
        self._outboxes: dict[str, asyncio.Queue[runtime_pb2.ExpertRequest | None]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._handed: set[asyncio.Task[None]] = set()  # pushes to this node being run
        self.sent = 0  # push messages sent (tests)

    def send(self, peer_id: str, rows: list[BatchRow], hidden: torch.Tensor) -> None:
        """Queue a push of ``hidden`` [B, T, D] to ``peer_id`` (rows name its sessions); never waits."""
        if peer_id == self._own:
            task = asyncio.create_task(self._hand_over(encode_request(PushStep(rows=rows), (hidden,))))
            self._handed.add(task)
            task.add_done_callback(self._handed.discard)
            self.sent += 1
            return
        outbox = self._outboxes.get(peer_id)
        if outbox is None or self._tasks[peer_id].done():
            outbox = self._outboxes[peer_id] = asyncio.Queue()
            self._tasks[peer_id] = asyncio.create_task(self._serve(peer_id, outbox), name=f"push-{peer_id[-6:]}")
        outbox.put_nowait(encode_request(PushStep(rows=rows), (hidden,)))
        self.sent += 1

    async def _serve(self, peer_id: str, outbox: asyncio.Queue[runtime_pb2.ExpertRequest | None]) -> None:
        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            while (request := await outbox.get()) is not None:
                yield request

        try:
            replies = await self._p2p.iterate_protobuf_handler(
                PeerID.from_base58(peer_id), PUSH_HANDLER, requests(), runtime_pb2.ExpertResponse
            )
            async for response in replies:
                reply, _ = decode_server_message(response)
                errors = reply.errors if isinstance(reply, PushAccepted) else [reply]
                for error in errors:
                    if isinstance(error, ErrorReply):
                        logger.debug("push to %s: %s %s", peer_id, error.code, error.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the gateway relays what did not arrive; the next push opens a new stream
            logger.info("push stream to %s ended: %s", peer_id, exc)

    async def _hand_over(self, request: runtime_pb2.ExpertRequest) -> None:
        """A push to this node, run as one that came over a stream would be (each on its own, as ``in_order``)."""
        assert self._local is not None  # only called with one
        try:
            await self._local(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # as a remote push's failure: the gateway relays what did not arrive
            logger.info("push to this node failed: %s", exc)

    def stop(self) -> None:
        """End every push stream (the node is stopping)."""
        for outbox in self._outboxes.values():
            outbox.put_nowait(None)
        for task in [*self._tasks.values(), *self._handed]:
            task.cancel()


async def run_rows(
    rows: list[BatchRow],
    hidden: torch.Tensor,
    sessions: list[Session | RemoteError],
    step: StepFn,
    links: PushLinks,
    pushed: bool = False,
) -> RowsOutcome:
    """Run each row (hidden [B, T, D], row b's first ``rows[b].tokens`` real) through its session's step slot, once
    however often it arrives; then push every row this call started onward, one message per next node. ``pushed``:
    the rows came from the previous node, which may never rewind a session."""

    async def one(b: int, session: Session | RemoteError) -> tuple[torch.Tensor, bool]:
        if isinstance(session, RemoteError):
            raise session

        async def run(row_hidden: torch.Tensor, position: int) -> torch.Tensor:
            step_trace.mark("node-run", session.session_id, position)
            output = await step(session, row_hidden, position)
            step_trace.mark("node-ran", session.session_id, position)
            return output

        pushed_at = session.kv.length if pushed else None
        slot, fresh = session.slots.offer(hidden[b : b + 1, : rows[b].tokens], rows[b].position, run, pushed_at)
        return await asyncio.shield(slot.output), fresh

    results = await asyncio.gather(*(one(b, s) for b, s in enumerate(sessions)), return_exceptions=True)
    outcome = _outcome(results, hidden, hidden)
    onward: dict[str, list[tuple[BatchRow, torch.Tensor]]] = {}
    for b, result in enumerate(results):
        if isinstance(result, tuple) and result[1] and rows[b].next:
            following = rows[b].next
            row = BatchRow(
                session_id=following[0].session_id,
                position=rows[b].position,
                next=following[1:],
                tokens=rows[b].tokens,
            )
            onward.setdefault(following[0].peer_id, []).append((row, result[0]))
    for peer_id, batch in onward.items():
        for row, _ in batch:
            step_trace.mark("node-push-out", row.session_id, row.position)
        links.send(peer_id, [row for row, _ in batch], right_padded([output for _, output in batch]))
    return outcome


async def wait_rows(
    rows: list[BatchRow], sessions: list[Session | RemoteError], wait: float, width: int
) -> RowsOutcome:
    """Each row's (input, output) once its pushed step has run here (``width``: the hidden size)."""

    async def one(b: int, session: Session | RemoteError) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(session, RemoteError):
            raise session
        return await session.slots.wait(rows[b].position, wait)

    results = await asyncio.gather(*(one(b, s) for b, s in enumerate(sessions)), return_exceptions=True)
    template = next((r[1] for r in results if isinstance(r, tuple)), torch.zeros(1, 1, width))
    like = template.new_zeros(len(rows), max(row.tokens for row in rows), width)
    inputs = right_padded([r[0] if isinstance(r, tuple) else like[b : b + 1] for b, r in enumerate(results)])
    return _outcome([(r[1], True) if isinstance(r, tuple) else r for r in results], like, inputs)


def _outcome(
    results: list[tuple[torch.Tensor, bool] | BaseException], like: torch.Tensor, inputs: torch.Tensor
) -> RowsOutcome:
    errors: list[ErrorReply | None] = []
    outputs = []
    for b, result in enumerate(results):
        if isinstance(result, tuple):
            errors.append(None)
            outputs.append(result[0])
            continue
        if not isinstance(result, RemoteError):
            if not isinstance(result, Exception):
                raise result
            logger.error("batched step failed", exc_info=result)
            result = NodeInternalError("internal error on the node")
        errors.append(ErrorReply.of(result))
        outputs.append(torch.zeros_like(like[b : b + 1]))
    return RowsOutcome(right_padded(outputs), inputs, errors)
