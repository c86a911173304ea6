"""Which decode steps run together: steps of different sessions that arrive close in time become one forward.

Decode is memory-bound — one step reads every weight of the span to produce one token — so B sessions' steps in one
forward (B rows of T=1, each at its own position) cost much less than B forwards. The policy:

* The first waiting step opens a batch; every step already queued joins it.
* The batch then waits only for the sessions that are *due*: each decoding session steps here with a rhythm (its
  previous interval between steps), and a session whose next step is expected before the wait ends is worth waiting
  for. The wait is at most about one forward's duration (a running average, capped by ``window``): a latecomer
  would otherwise cost a forward of its own, so waiting longer than that for it gains nothing. Sessions elsewhere in
  the chain for longer (another group of streams on the next node) are not waited for: the node runs what it has,
  and the groups keep several nodes busy in a pipeline. A lone stream never waits.
* ``max_batch`` caps the rows of a forward. While a batch runs on the compute thread, new steps queue for the next.
* Rows for different block ranges (a client may use a sub-range of the span) run as separate forwards.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from shared.arrival_forecast import ArrivalForecast, wait_for_arrivals
from swarm_node.kv_cache import SessionKV

logger = logging.getLogger(__name__)

FORWARD_SMOOTHING = 0.2  # weight of the newest decode forward's duration in the running estimate

# Runs one forward: (sessions, hidden [B, 1, D], positions) -> [B, 1, D].
RunBatch = Callable[[list[SessionKV], torch.Tensor, list[int]], Awaitable[torch.Tensor]]


@dataclass(frozen=True)
class BatchPolicy:
    window: float = 0.1  # seconds a batch waits, at most, for sessions due to step (less: about one forward)
    max_batch: int = 32  # rows in one decode forward
    prefill_chunk: int = 512  # padded prompt tokens per prefill forward: bounds activation memory


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
        # A plain deque and an event rather than asyncio.Queue: on Python 3.11 ``wait_for(queue.get(), t)`` can drop
        # an item when the timeout and the arrival coincide, and a dropped step would hang its session.
        self._queue: deque[_Request] = deque()
        self._arrival = asyncio.Event()
        self._forecast: ArrivalForecast[SessionKV] = ArrivalForecast()
        self._forward_seconds: float | None = None  # running average of a decode forward's duration
        self._task: asyncio.Task[None] | None = None
        self.batch_sizes: deque[int] = deque(maxlen=1000)  # rows of recent forwards, newest last (tests, bench)

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def submit(self, kv: SessionKV, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, 1, D] of one session at ``position`` -> [1, 1, D], computed in some batch."""
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = asyncio.create_task(self._serve_forever(), name="decode-batcher")
        self._forecast.arrived(kv, loop.time())
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        self._queue.append(_Request(kv, hidden, position, future))
        self._arrival.set()
        return await future

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        while self._queue:
            self._queue.popleft().future.cancel()

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
        while not self._queue:
            self._arrival.clear()
            await self._arrival.wait()
        batch: list[_Request] = []
        self._drain_into(batch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.policy.window, self._forward_seconds or self.policy.window)
        due = self._forecast.due(loop.time(), deadline, {request.kv for request in batch})
        wanted = min(self.policy.max_batch, len(batch) + due)
        await wait_for_arrivals(self._arrival, lambda: len(batch) + len(self._queue), wanted, deadline)
        self._drain_into(batch)
        return batch

    def _drain_into(self, batch: list[_Request]) -> None:
        while len(batch) < self.policy.max_batch and self._queue:
            batch.append(self._queue.popleft())

    async def _run(self, group: list[_Request]) -> None:
        began = asyncio.get_running_loop().time()
        try:
            hidden = torch.cat([request.hidden for request in group])  # [B, 1, D]
            output = await self._run_batch([r.kv for r in group], hidden, [r.position for r in group])
        except Exception as error:  # the batch failed: every step in it fails the same way; the loop goes on
            for request in group:
                if not request.future.done():
                    request.future.set_exception(error)
            return
        self.batch_sizes.append(len(group))
        took = asyncio.get_running_loop().time() - began
        if self._forward_seconds is not None:
            took = (1 - FORWARD_SMOOTHING) * self._forward_seconds + FORWARD_SMOOTHING * took
        self._forward_seconds = took
        logger.debug("decode batch of %d rows", len(group))
        for row, request in enumerate(group):
            if not request.future.done():
                request.future.set_result(output[row : row + 1])
