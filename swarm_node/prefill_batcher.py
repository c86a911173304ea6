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

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from swarm_node.kv_cache import SessionKV

# Runs one padded forward: (sessions, hidden [B, T, D], starts, real lengths) -> [B, T, D].
RunPrefill = Callable[[list[SessionKV], torch.Tensor, list[int], list[int]], Awaitable[torch.Tensor]]


@dataclass
class _Prompt:
    kv: SessionKV
    hidden: torch.Tensor  # [1, T, D]
    position: int
    future: asyncio.Future[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.hidden.shape[1])


class PrefillBatcher:
    def __init__(self, max_tokens: int, run: RunPrefill) -> None:
        self.max_tokens = max_tokens
        self._run = run
        self._waiting: list[_Prompt] = []
        self._worker: asyncio.Task[None] | None = None
        self.batch_sizes: deque[int] = deque(maxlen=1000)  # rows of recent forwards, newest last (tests, bench)

    async def submit(self, kv: SessionKV, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden [1, T, D] (T <= max_tokens) at ``position`` -> [1, T, D], computed with whatever else queued."""
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Prompt(kv, hidden, position, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain(), name="prefill-batcher")
        return await future

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        for prompt in self._waiting:
            prompt.future.cancel()
        self._waiting.clear()

    async def _drain(self) -> None:
        while self._waiting:
            batch = self._take()
            if batch:
                await self._forward(batch)

    def _take(self) -> list[_Prompt]:
        """The next forward's prompts, in arrival order: live ones of the first one's block range, within the bound."""
        self._waiting = [prompt for prompt in self._waiting if not prompt.future.done()]  # callers that left
        if not self._waiting:
            return []
        blocks, longest = self._waiting[0].kv.blocks, 0
        batch: list[_Prompt] = []
        rest: list[_Prompt] = []
        for prompt in self._waiting:
            widest = max(longest, prompt.length)
            if prompt.kv.blocks == blocks and widest * (len(batch) + 1) <= self.max_tokens:
                batch.append(prompt)
                longest = widest
            else:
                rest.append(prompt)
        self._waiting = rest
        return batch

    async def _forward(self, batch: list[_Prompt]) -> None:
        width = max(prompt.length for prompt in batch)
        hidden = torch.zeros(len(batch), width, batch[0].hidden.shape[-1], dtype=batch[0].hidden.dtype)
        for row, prompt in enumerate(batch):
            hidden[row, : prompt.length] = prompt.hidden[0]
        lengths = [prompt.length for prompt in batch]
        try:
            output = await self._run([p.kv for p in batch], hidden, [p.position for p in batch], lengths)
        except Exception as error:  # every prompt of a failed forward fails the same way; the batcher goes on
            for prompt in batch:
                if not prompt.future.done():
                    prompt.future.set_exception(error)
            return
        self.batch_sizes.append(len(batch))
        for row, prompt in enumerate(batch):
            if not prompt.future.done():
                prompt.future.set_result(output[row : row + 1, : prompt.length])
