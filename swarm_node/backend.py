"""The span's compute: one worker thread owns the model and runs every torch call, so the event loop never waits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from shared.kv_cache import SessionKV
from shared.span import BlockSpan

T = TypeVar("T")


class SpanBackend:
    def __init__(self, span: BlockSpan) -> None:
        self.span = span
        self.dtype = next(span.parameters()).dtype
        self.device = next(span.parameters()).device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="span-compute")
        self._pending = 0

    @property
    def queue_depth(self) -> int:
        """Calls submitted to the compute thread and not finished yet (announced so routers can spread load)."""
        return self._pending

    async def _run(self, fn: Callable[[], T]) -> T:
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
        finally:
            self._pending -= 1

    async def new_session_kv(self, blocks: range, max_length: int) -> SessionKV:
        return await self._run(lambda: self.span.new_session_kv(blocks, max_length))

    async def step(self, kv: SessionKV, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, T, D] at positions position..position+T-1 -> [1, T, D] in the caller's dtype."""
        return await self._run(lambda: self._forward(hidden, [kv], [position], kv.blocks))

    async def forward(self, hidden: torch.Tensor, blocks: range) -> torch.Tensor:
        """Stateless: hidden [B, T, D] from position 0, through ``blocks``."""

        def run() -> torch.Tensor:
            kvs = [self.span.new_session_kv(blocks, hidden.shape[1]) for _ in range(hidden.shape[0])]
            return self._forward(hidden, kvs, [0] * len(kvs), blocks)

        return await self._run(run)

    def _forward(self, hidden: torch.Tensor, kvs: list[SessionKV], starts: list[int], blocks: range) -> torch.Tensor:
        wire_dtype = hidden.dtype
        output = self.span(hidden.to(self.device, self.dtype), kvs, starts, blocks)
        return output.to("cpu", wire_dtype)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
