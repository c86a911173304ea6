"""The LM head of concurrent sessions as one matmul.

The head reads its whole [V, D] weight for every token it scores (SmolLM2: 49152 × 576 floats, 113 MB in float32),
so scoring one session at a time makes the gateway, not the swarm, the bottleneck of many concurrent streams: eight
streams cost eight reads of the weight per step. Here every session's last hidden state that arrives while a batch
is computing waits for the next batch, which scores them all in one [B, D] × [D, V] product. A batch that opens also
waits for the sessions due at the head (``shared.batching.Rhythm``), and a lone stream never waits:

* briefly (about one batch's duration): the rows of one node batch reach the gateway over a few milliseconds, and
  scoring the first alone would split the group, and every node batch after it;
* up to ``merge_window`` while the rows are a minority of the running sessions: a straggler out of phase with the
  others would otherwise cost a forward of its own on every node, every step, for the rest of its life. It waits
  once, then steps with the group. Groups in different phases merge the same way: decode is memory-bound, so one
  forward of 2B rows costs far less than two forwards of B rows.

Each row's sampling (its own sampler, penalties and seed) runs right after, in the same worker thread, so no
session's tokens depend on who else was in the batch. A row may bring several positions (``score(positions=True)``: a
speculative verify step's k+1): they go into the same matmul as rows of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shared.batching import Batcher, Job, Rhythm


@dataclass
class _Row:
    hidden: torch.Tensor  # [1, T, D]
    finish: Callable[[torch.Tensor], Any]  # logits [V] (or [T, V] when ``positions``) -> the caller's result
    adapter: str | None = None  # the LoRA adapter whose head parts score this row
    positions: bool = False


class HeadBatcher(Batcher[_Row, Any]):
    def __init__(
        self,
        logits: Callable[[torch.Tensor, Sequence[str | None]], torch.Tensor],
        window: float = 0.02,
        merge_window: float = 0.25,
    ) -> None:
        self._logits = logits  # (hidden [B, 1, D], each row's adapter) -> logits [B, 1, V]
        # window: seconds a batch waits, at most, for due sessions (less: about one batch's duration);
        # merge_window: seconds a minority of the running sessions waits for the rest.
        super().__init__(self._score_rows, name="head-batcher", rhythm=Rhythm(window, merge_window))

    async def score(
        self,
        hidden: torch.Tensor,
        finish: Callable[[torch.Tensor], Any],
        session: object | None = None,
        adapter: str | None = None,
        positions: bool = False,
    ) -> Any:
        """``finish(logits)`` for ``hidden`` [1, T, D] — computed with whatever other rows are waiting: the last
        position's logits [V], or with ``positions`` every position's [T, V] (a speculative round's verify).

        ``session``: one object per generation (weakly held), whose rhythm tells when its next row is due;
        ``adapter``: the LoRA adapter whose LM-head part applies to this row (rows of others share the batch).
        """
        return await self.submit(_Row(hidden, finish, adapter, positions), session)

    async def _score_rows(self, jobs: list[Job[_Row, Any]]) -> None:
        results = await asyncio.to_thread(self._compute, [job.item for job in jobs])
        for job, (ok, value) in zip(jobs, results, strict=True):
            if ok:
                job.resolve(value)
            else:
                job.fail(value)

    def _compute(self, rows: list[_Row]) -> list[tuple[bool, Any]]:
        # every position a row of one matmul: [N, 1, D] -> [N, 1, V], N = the rows' positions in all
        adapters = [row.adapter for row in rows for _ in range(row.hidden.shape[1])]
        logits = self._logits(torch.cat([row.hidden.transpose(0, 1) for row in rows]), adapters)[:, -1]  # [N, V]
        results: list[tuple[bool, Any]] = []
        offset = 0
        for row in rows:
            count = row.hidden.shape[1]
            scored = logits[offset : offset + count]  # [T, V]
            offset += count
            try:
                results.append((True, row.finish(scored if row.positions else scored[-1])))
            except Exception as error:  # one row's sampling error is that row's alone
                results.append((False, error))
        return results
