"""The LM head of concurrent sessions as one matmul.

The head reads its whole [V, D] weight for every token it scores (SmolLM2: 49152 × 576 floats, 113 MB in float32),
so scoring one session at a time makes the gateway, not the swarm, the bottleneck of many concurrent streams: eight
streams cost eight reads of the weight per step. Here every session's last hidden state that arrives while a batch
is computing waits for the next batch, which scores them all in one [B, D] × [D, V] product — no waiting window,
a lone stream runs at once. Each row's sampling (its own sampler, penalties and seed) runs right after, in the
same worker thread, so no session's tokens depend on who else was in the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Row:
    hidden: torch.Tensor  # [1, 1, D]
    finish: Callable[[torch.Tensor], Any]  # logits [V] -> the caller's result (sampled token, logprobs)
    future: asyncio.Future[Any]


class HeadBatcher:
    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._logits = logits  # hidden [B, 1, D] -> logits [B, 1, V]
        self._waiting: list[_Row] = []
        self._worker: asyncio.Task[None] | None = None
        self.batch_sizes: list[int] = []  # rows of recent batches (tests, benchmarks); bounded below

    async def score(self, hidden: torch.Tensor, finish: Callable[[torch.Tensor], Any]) -> Any:
        """``finish(logits)`` for ``hidden`` [1, 1, D] — computed with whatever other rows are waiting."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Row(hidden, finish, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            batch = [row for row in batch if not row.future.done()]  # callers cancelled meanwhile
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self._compute, batch)
            except BaseException as error:  # the head itself failed (or the loop is shutting down)
                for row in batch:
                    if not row.future.done():
                        row.future.set_exception(error if isinstance(error, Exception) else RuntimeError(error))
                if not isinstance(error, Exception):
                    raise
                continue
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
