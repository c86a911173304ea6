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

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from shared.batching import Batcher, Job, Rhythm
from swarm_node.kv_cache import SessionKV

logger = logging.getLogger(__name__)

# Runs one forward: (sessions, hidden [B, 1, D], positions) -> [B, 1, D].
RunBatch = Callable[[list[SessionKV], torch.Tensor, list[int]], Awaitable[torch.Tensor]]


@dataclass(frozen=True)
class BatchPolicy:
    window: float = 0.1  # seconds a batch waits, at most, for sessions due to step (less: about one forward)
    max_batch: int = 32  # rows in one decode forward
    prefill_chunk: int = 512  # padded prompt tokens per prefill forward: bounds activation memory


@dataclass
class _Step:
    kv: SessionKV
    hidden: torch.Tensor  # [1, 1, D]
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

    async def step(self, kv: SessionKV, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, 1, D] of one session at ``position`` -> [1, 1, D], computed in some batch."""
        return await self.submit(_Step(kv, hidden, position), kv)

    async def _forward(self, jobs: list[Job[_Step, torch.Tensor]]) -> None:
        steps = [job.item for job in jobs]
        hidden = torch.cat([step.hidden for step in steps])  # [B, 1, D]
        output = await self._run_batch([s.kv for s in steps], hidden, [s.position for s in steps])
        logger.debug("decode batch of %d rows", len(jobs))
        for row, job in enumerate(jobs):
            job.resolve(output[row : row + 1])
