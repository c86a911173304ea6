"""The LM head of concurrent sessions as one matmul.

The head reads its whole [V, D] weight for every token it scores (SmolLM2: 49152 × 576 floats, 113 MB in float32),
so scoring one session at a time makes the gateway, not the swarm, the bottleneck of many concurrent streams: eight
streams cost eight reads of the weight per step. Here every session's last hidden state that arrives while a batch
is computing waits for the next batch, which scores them all in one [B, D] × [D, V] product. A batch that opens also
waits for the sessions due at the head (``ArrivalForecast``), and a lone stream never waits:

* briefly (about one batch's duration): the rows of one node batch reach the gateway over a few milliseconds, and
  scoring the first alone would split the group, and every node batch after it;
* up to ``merge_window`` while the rows are a minority of the running sessions: a straggler out of phase with the
  others would otherwise cost a forward of its own on every node, every step, for the rest of its life. It waits
  once, then steps with the group. Groups in different phases merge the same way: decode is memory-bound, so one
  forward of 2B rows costs far less than two forwards of B rows.

Each row's sampling (its own sampler, penalties and seed) runs right after, in the same worker thread, so no
session's tokens depend on who else was in the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shared.arrival_forecast import ArrivalForecast, wait_for_arrivals

COMPUTE_SMOOTHING = 0.2  # weight of the newest batch's duration in the running estimate


@dataclass
class _Row:
    hidden: torch.Tensor  # [1, 1, D]
    finish: Callable[[torch.Tensor], Any]  # logits [V] -> the caller's result (sampled token, logprobs)
    future: asyncio.Future[Any]
    session: object | None


class HeadBatcher:
    def __init__(
        self, logits: Callable[[torch.Tensor], torch.Tensor], window: float = 0.02, merge_window: float = 0.25
    ) -> None:
        self._logits = logits  # hidden [B, 1, D] -> logits [B, 1, V]
        self.window = window  # seconds a batch waits, at most, for due sessions (less: about one batch's duration)
        self.merge_window = merge_window  # seconds a minority of the running sessions waits for the rest
        self._waiting: list[_Row] = []
        self._arrival = asyncio.Event()
        self._forecast: ArrivalForecast[object] = ArrivalForecast()
        self._compute_seconds: float | None = None  # running average of one batch's duration
        self._worker: asyncio.Task[None] | None = None
        self.batch_sizes: list[int] = []  # rows of recent batches (tests, benchmarks); bounded below

    async def score(
        self, hidden: torch.Tensor, finish: Callable[[torch.Tensor], Any], session: object | None = None
    ) -> Any:
        """``finish(logits)`` for ``hidden`` [1, 1, D] — computed with whatever other rows are waiting.

        ``session``: one object per generation (weakly held), whose rhythm tells when its next row is due.
        """
        loop = asyncio.get_running_loop()
        if session is not None:
            self._forecast.arrived(session, loop.time())
        future: asyncio.Future[Any] = loop.create_future()
        self._waiting.append(_Row(hidden, finish, future, session))
        self._arrival.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    def forget(self, session: object) -> None:
        """``session`` ended: no batch waits for it any more."""
        self._forecast.forget(session)

    async def _wait_for_due(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        present = {row.session for row in self._waiting if row.session is not None}
        if 2 * len(self._waiting) < self._forecast.running(now):  # a minority: the rest may be worth a longer wait
            deadline = now + self.merge_window
        else:
            deadline = now + min(self.window, self._compute_seconds or self.window)
        wanted = len(self._waiting) + self._forecast.due(now, deadline, present)
        await wait_for_arrivals(self._arrival, lambda: len(self._waiting), wanted, deadline)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            await self._wait_for_due()
            batch, self._waiting = self._waiting, []
            batch = [row for row in batch if not row.future.done()]  # callers cancelled meanwhile
            if not batch:
                continue
            began = loop.time()
            try:
                results = await asyncio.to_thread(self._compute, batch)
            except BaseException as error:  # the head itself failed (or the loop is shutting down)
                for row in batch:
                    if not row.future.done():
                        row.future.set_exception(error if isinstance(error, Exception) else RuntimeError(error))
                if not isinstance(error, Exception):
                    raise
                continue
            took = loop.time() - began
            if self._compute_seconds is not None:
                took = (1 - COMPUTE_SMOOTHING) * self._compute_seconds + COMPUTE_SMOOTHING * took
            self._compute_seconds = took
            for row, (ok, value) in zip(batch, results, strict=True):
                if row.future.done():
                    continue
                if ok:
                    row.future.set_result(value)
                else:
                    row.future.set_exception(value)
            self.batch_sizes.append(len(batch))
            if len(self.batch_sizes) > 1000:
                del self.batch_sizes[:500]

    def _compute(self, batch: list[_Row]) -> list[tuple[bool, Any]]:
        logits = self._logits(torch.cat([row.hidden for row in batch]))  # [B, 1, V]
        results: list[tuple[bool, Any]] = []
        for index, row in enumerate(batch):
            try:
                results.append((True, row.finish(logits[index, -1])))
            except Exception as error:  # one row's sampling error is that row's alone
                results.append((False, error))
        return results

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
