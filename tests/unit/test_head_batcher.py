"""The gateway's LM-head batcher: concurrent sessions share one matmul, and each still gets exactly its own result."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from gateway.head_batcher import HeadBatcher

D, V = 16, 50


@pytest.fixture
def head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(D, V, bias=False)


async def test_concurrent_rows_share_a_batch_and_each_gets_its_own_argmax(head: torch.nn.Linear) -> None:
    release = threading.Event()
    calls: list[int] = []

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden.shape[0])
        release.wait(5)  # the first batch holds the worker until every other row is waiting
        return head(hidden)

    batcher = HeadBatcher(logits)
    rows = [torch.randn(1, 1, D) for _ in range(6)]
    first = asyncio.create_task(batcher.score(rows[0], lambda lg: int(lg.argmax())))
    await asyncio.sleep(0.05)
    rest = [asyncio.create_task(batcher.score(row, lambda lg: int(lg.argmax()))) for row in rows[1:]]
    await asyncio.sleep(0.05)
    release.set()
    results = await asyncio.gather(first, *rest)
    with torch.no_grad():
        assert results == [int(head(row)[0, -1].argmax()) for row in rows]
    assert calls == [1, 5]  # a lone row runs at once; the five that came meanwhile run as one batch
    await batcher.close()


async def test_a_failing_row_and_a_cancelled_caller_leave_the_others_untouched(head: torch.nn.Linear) -> None:
    gate = threading.Event()

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        gate.wait(5)
        return head(hidden)

    def boom(_: torch.Tensor) -> int:
        raise ValueError("bad sampling parameters")

    batcher = HeadBatcher(logits)
    blocker = asyncio.create_task(batcher.score(torch.randn(1, 1, D), lambda lg: 0))
    await asyncio.sleep(0.05)
    good = asyncio.create_task(batcher.score(torch.randn(1, 1, D), lambda lg: int(lg.argmax())))
    bad = asyncio.create_task(batcher.score(torch.randn(1, 1, D), boom))
    gone = asyncio.create_task(batcher.score(torch.randn(1, 1, D), lambda lg: 1))
    await asyncio.sleep(0.05)
    gone.cancel()
    gate.set()
    assert await blocker == 0
    assert 0 <= await good < V
    with pytest.raises(ValueError, match="bad sampling"):
        await bad
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert batcher.batch_sizes == [1, 2]  # the cancelled caller's row was dropped before computing
    await batcher.close()
