"""Which decode steps run together: steps of different sessions that arrive close in time become one forward.

Decode is memory-bound — one step reads every weight of the span to produce one token — so B sessions' steps in one
forward (B rows of T=1, each at its own position) cost little more than one. The policy:

* The first waiting step starts a batch. The batch closes when it holds as many steps as there are sessions
  decoding right now (those that stepped within the last ``ACTIVE_HORIZON`` seconds: nobody else is coming), when it
  reaches ``max_batch``, or ``window`` seconds after the first step arrived, whichever comes first. So a lone stream
  never waits, and concurrent streams wait at most ``window`` for each other.
* While a batch runs on the compute thread, new steps queue; they form the next batch as soon as it is done.
* Rows for different block ranges (a client may use a sub-range of the span) run as separate forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from shared.kv_cache import SessionKV

logger = logging.getLogger(__name__)

ACTIVE_HORIZON = 1.0  # seconds since its last step during which a session counts as decoding

# Runs one forward: (sessions, hidden [B, 1, D], positions) -> [B, 1, D].
RunBatch = Callable[[list[SessionKV], torch.Tensor, list[int]], Awaitable[torch.Tensor]]


@dataclass(frozen=True)
class BatchPolicy:
    window: float = 0.005  # seconds the first step of a batch waits for other sessions' steps
    max_batch: int = 32  # rows in one decode forward
    prefill_chunk: int = 512  # prompt tokens per prefill forward: bounds activation memory for long prompts


@dataclass
class _Request:
    kv: SessionKV
    hidden: torch.Tensor  # [1, 1, D]
    position: int
    future: asyncio.Future[torch.Tensor]


class DecodeBatcher:
    def __init__(self, policy: BatchPolicy, run_batch: RunBatch) -> None:
        self.policy = policy
        self._run_batch = run_batch
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._last_step: weakref.WeakKeyDictionary[SessionKV, float] = weakref.WeakKeyDictionary()
        self._task: asyncio.Task[None] | None = None
        self.batch_sizes: deque[int] = deque(maxlen=1000)  # rows of recent forwards, newest last (tests, bench)

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def submit(self, kv: SessionKV, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, 1, D] of one session at ``position`` -> [1, 1, D], computed in some batch."""
        if self._task is None:
            self._task = asyncio.create_task(self._serve_forever(), name="decode-batcher")
        self._last_step[kv] = time.monotonic()
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Request(kv, hidden, position, future))
        return await future

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        while not self._queue.empty():
            self._queue.get_nowait().future.cancel()

    def _decoding_now(self) -> int:
        horizon = time.monotonic() - ACTIVE_HORIZON
        return sum(1 for last in list(self._last_step.values()) if last >= horizon)

    async def _serve_forever(self) -> None:
        while True:
            batch = await self._collect()
            live = [request for request in batch if not request.future.done()]  # skip steps whose client left
            groups: dict[range, list[_Request]] = {}
            for request in live:
                groups.setdefault(request.kv.blocks, []).append(request)
            for group in groups.values():
                await self._run(group)

    async def _collect(self) -> list[_Request]:
        batch = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.window
        expected = min(self.policy.max_batch, self._decoding_now())
        while len(batch) < expected and (remaining := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
        while len(batch) < self.policy.max_batch and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    async def _run(self, group: list[_Request]) -> None:
        try:
            hidden = torch.cat([request.hidden for request in group])  # [B, 1, D]
            output = await self._run_batch([r.kv for r in group], hidden, [r.position for r in group])
        except Exception as error:  # the batch failed: every step in it fails the same way; the loop goes on
            for request in group:
                if not request.future.done():
                    request.future.set_exception(error)
            return
        self.batch_sizes.append(len(group))
        for row, request in enumerate(group):
            if not request.future.done():
                request.future.set_result(output[row : row + 1])
