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
* A row may bring several tokens (a speculative verify step: the last token and its drafts): rows of different
  lengths run in the same forward, packed (``BlockSpan.forward``), so a verify row costs the batch only its extra
  positions' compute — small while decode is memory-bound — instead of a forward of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from shared.batching import Batcher, Job, Rhythm
from shared.wire import MAX_ROW_TOKENS
from swarm_node.kv_cache import SessionKV

logger = logging.getLogger(__name__)

# Runs one forward: (sessions, hidden [B, T, D], positions, lengths) -> [B, T, D]; row b's real tokens are its first
# lengths[b] (right padding after them); lengths is None when every row brings one token.
RunBatch = Callable[[list[SessionKV], torch.Tensor, list[int], list[int] | None], Awaitable[torch.Tensor]]


@dataclass(frozen=True)
class BatchPolicy:
    window: float = 0.1  # seconds a batch waits, at most, for sessions due to step (less: about one forward)
    max_batch: int = 32  # rows in one decode forward
    max_row_tokens: int = MAX_ROW_TOKENS  # tokens of one row (a verify step's); longer steps are prefills
    prefill_chunk: int = 512  # padded prompt tokens per prefill forward: bounds activation memory


@dataclass
class _Step:
    kv: SessionKV
    hidden: torch.Tensor  # [1, T, D]
    position: int


class DecodeBatcher(Batcher[_Step, torch.Tensor]):
    def __init__(self, policy: BatchPolicy, run_batch: RunBatch) -> None:
        self.policy = policy
        self._run_batch = run_batch
        super().__init__(
            self._forward,
            name="decode-batcher",
            rhythm=Rhythm(policy.window),
            max_items=policy.max_batch,
            group=lambda step: step.kv.blocks,  # a sub-range of the span is a forward of its own
        )
        self.mixed = 0  # forwards whose rows brought different numbers of tokens (verify rows beside decode rows)

    async def step(self, kv: SessionKV, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, T, D] of one session at positions ``position``... -> [1, T, D], computed in some batch."""
        return await self.submit(_Step(kv, hidden, position), kv)

    async def _forward(self, jobs: list[Job[_Step, torch.Tensor]]) -> None:
        steps = [job.item for job in jobs]
        lengths = [step.hidden.shape[1] for step in steps]
        if max(lengths) == 1:
            hidden, ragged = torch.cat([step.hidden for step in steps]), None  # [B, 1, D]
        else:  # right-padded [B, T, D]; the span computes only the real tokens
            hidden, ragged = steps[0].hidden.new_zeros(len(steps), max(lengths), steps[0].hidden.shape[2]), lengths
            self.mixed += min(lengths) < max(lengths)
            for row, step in enumerate(steps):
                hidden[row, : lengths[row]] = step.hidden[0]
        output = await self._run_batch([s.kv for s in steps], hidden, [s.position for s in steps], ragged)
        logger.debug("decode batch of %d rows, %d positions", len(jobs), sum(lengths))
        for row, job in enumerate(jobs):
            job.resolve(output[row : row + 1, : lengths[row]])
