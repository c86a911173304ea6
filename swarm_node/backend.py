"""The span's compute: one worker thread owns the model and runs every torch call, so the event loop never waits.

Steps reach the compute thread in three ways: decode steps (one new token) through the ``DecodeBatcher``, which
merges concurrent sessions' steps into one forward; prompts of up to ``prefill_chunk`` tokens through the
``PrefillBatcher``, which merges those queued meanwhile into one right-padded forward; longer prompts alone, in
chunks of at most ``prefill_chunk`` tokens — each chunk its own job, so decode batches of other sessions run between
the chunks of a long prompt instead of waiting for all of it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from swarm_node.capacity import return_freed_memory
from swarm_node.decode_batcher import BatchPolicy, DecodeBatcher
from swarm_node.faults import lie_about
from swarm_node.kv_cache import SessionKV
from swarm_node.metrics import NodeMetrics
from swarm_node.prefill_batcher import PrefillBatcher
from swarm_node.span import BlockSpan

T = TypeVar("T")


class SpanBackend:
    def __init__(
        self,
        span: BlockSpan,
        policy: BatchPolicy | None = None,
        metrics: NodeMetrics | None = None,
        fault: str = "none",
    ) -> None:
        self.span = span
        self.fault = fault  # testing only: a --faulty-outputs mode that lies in every forward (swarm_node.faults)
        self.policy = policy or BatchPolicy()
        self.metrics = metrics
        self.dtype = span.cache_dtype
        self.device = span.device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="span-compute")
        self._pending = 0
        self.batcher = DecodeBatcher(self.policy, self._decode_batch)
        self.prefills = PrefillBatcher(self.policy.prefill_chunk, self._prefill_batch)
        return_freed_memory()  # the span was just loaded: its loading buffers are garbage now

    @property
    def queue_depth(self) -> int:
        """Steps waiting for or running on the compute thread (announced so routers can spread load)."""
        return self._pending + self.batcher.pending

    async def _run(self, fn: Callable[[], T]) -> T:
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
        finally:
            self._pending -= 1

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the compute thread (the node's self-test: every torch call on the span runs there)."""
        return await self._run(fn)

    async def new_session_kv(self, blocks: range, max_length: int, adapter: str | None = None) -> SessionKV:
        return await self._run(lambda: self.span.new_session_kv(blocks, max_length, adapter))

    async def resize_session_kv(self, kv: SessionKV, max_length: int) -> None:
        # On the compute thread: no forward may read the tensors while they are swapped.
        await self._run(lambda: kv.resize(max_length))

    async def serve_step(
        self, kv: SessionKV, hidden: torch.Tensor, position: int, parents: Sequence[int] | None = None
    ) -> torch.Tensor:
        """A client's step, hidden [1, T, D] at ``position``: batched with others' steps or prompts unless longer than
        a prefill chunk (then alone, in chunks). A tree step (``parents``) runs alone, in one forward."""
        if parents is not None:
            return await self._run(functools.partial(self._forward, hidden, [kv], [position], kv.blocks, None, parents))
        if hidden.shape[1] == 1:
            return await self.batcher.step(kv, hidden, position)
        if hidden.shape[1] <= self.policy.prefill_chunk:
            return await self.prefills.prefill(kv, hidden, position)
        return await self.step(kv, hidden, position)

    async def step(self, kv: SessionKV, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """This session alone, now: hidden [1, T, D] at positions position... -> [1, T, D] in the caller's dtype."""
        chunk = self.policy.prefill_chunk
        outputs = []
        for offset in range(0, hidden.shape[1], chunk):
            part = hidden[:, offset : offset + chunk]
            run = functools.partial(self._forward, part, [kv], [position + offset], kv.blocks)
            outputs.append(await self._run(run))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    async def forward(self, hidden: torch.Tensor, blocks: range, adapter: str | None = None) -> torch.Tensor:
        """Stateless: hidden [B, T, D] from position 0 through ``blocks`` (with ``adapter``'s LoRA pairs, if named),
        in prefill chunks like ``step``."""
        kvs = await self._run(lambda: [self.span.new_session_kv(blocks, hidden.shape[1], adapter) for _ in hidden])
        chunk = self.policy.prefill_chunk
        outputs = []
        for offset in range(0, hidden.shape[1], chunk):
            part = hidden[:, offset : offset + chunk]
            run = functools.partial(self._forward, part, kvs, [offset] * len(kvs), blocks)
            outputs.append(await self._run(run))
        return torch.cat(outputs, dim=1)

    async def _decode_batch(self, kvs: list[SessionKV], hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
        if self.metrics is not None:
            self.metrics.decode_batch(len(kvs))
        return await self._run(functools.partial(self._forward, hidden, kvs, positions, kvs[0].blocks))

    async def _prefill_batch(
        self, kvs: list[SessionKV], hidden: torch.Tensor, starts: list[int], lengths: list[int]
    ) -> torch.Tensor:
        return await self._run(functools.partial(self._forward, hidden, kvs, starts, kvs[0].blocks, lengths))

    def _forward(
        self,
        hidden: torch.Tensor,
        kvs: list[SessionKV],
        starts: list[int],
        blocks: range,
        lengths: list[int] | None = None,
        parents: Sequence[int] | None = None,
    ) -> torch.Tensor:
        began = time.perf_counter()
        wire_dtype = hidden.dtype
        inputs = hidden.to(self.device, self.dtype)
        output = self.span(inputs, kvs, starts, blocks, lengths, parents).to("cpu", wire_dtype)
        output = lie_about(self.fault, hidden, output)
        if self.metrics is not None:  # hidden: [B, T, D]
            self.metrics.forward(hidden.shape[0], hidden.shape[1], time.perf_counter() - began)
        return output

    def shutdown(self) -> None:
        self.batcher.stop()
        self.prefills.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
