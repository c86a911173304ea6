"""Which prompts are prefilled together: prompts of different sessions that queue while the span is busy.

Streams that start together (a burst of requests, a benchmark) send their prompts within milliseconds. Prefilled one
by one, the last waits for all the others, and their first decode steps reach the node staggered by a prompt's
forward each, so batched decode needs many steps to gather them again. As one right-padded forward the prompts
cost about what the longest alone costs (a few short rows multiply the weights no worse than one), and the sessions
start decoding in step.

The policy mirrors the LM head's: the first prompt runs at once (a lone request never waits); those that arrive
while a forward runs (prefill or decode: they share the compute thread) join the next, up to ``max_tokens`` padded
tokens (rows x the longest prompt: what bounds its activation memory) and of the same block range.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from shared.batching import Batcher, Job
from swarm_node.kv_cache import SessionKV

# Runs one padded forward: (sessions, hidden [B, T, D], starts, real lengths) -> [B, T, D].
RunPrefill = Callable[[list[SessionKV], torch.Tensor, list[int], list[int]], Awaitable[torch.Tensor]]


@dataclass
class _Prompt:
    kv: SessionKV
    hidden: torch.Tensor  # [1, T, D]
    position: int

    @property
    def length(self) -> int:
        return int(self.hidden.shape[1])


class PrefillBatcher(Batcher[_Prompt, torch.Tensor]):
    def __init__(self, max_tokens: int, run: RunPrefill) -> None:
        self.max_tokens = max_tokens
        self._run_forward = run
        super().__init__(self._forward, name="prefill-batcher", fits=self._fits)

    async def prefill(self, kv: SessionKV, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden [1, T, D] (T <= max_tokens) at ``position`` -> [1, T, D], computed with whatever else queued."""
        return await self.submit(_Prompt(kv, hidden, position))

    def _fits(self, taken: list[_Prompt], prompt: _Prompt) -> bool:
        """Of the first prompt's block range, and the padded rows within ``max_tokens``."""
        widest = max(prompt.length, *(p.length for p in taken))
        return prompt.kv.blocks == taken[0].kv.blocks and widest * (len(taken) + 1) <= self.max_tokens

    async def _forward(self, jobs: list[Job[_Prompt, torch.Tensor]]) -> None:
        prompts = [job.item for job in jobs]
        width = max(prompt.length for prompt in prompts)
        hidden = torch.zeros(len(prompts), width, prompts[0].hidden.shape[-1], dtype=prompts[0].hidden.dtype)
        for row, prompt in enumerate(prompts):
            hidden[row, : prompt.length] = prompt.hidden[0]
        lengths = [prompt.length for prompt in prompts]
        output = await self._run_forward([p.kv for p in prompts], hidden, [p.position for p in prompts], lengths)
        for row, (job, prompt) in enumerate(zip(jobs, prompts, strict=True)):
            job.resolve(output[row : row + 1, : prompt.length])
