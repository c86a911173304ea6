"""The gateway's LM-head batcher: concurrent sessions share one matmul, and each still gets exactly its own result."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
import torch

from gateway.model.head_batcher import HeadBatcher
from tests.helpers.polling import eventually

D, V = 16, 50


@pytest.fixture
def head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(D, V, bias=False)


async def test_concurrent_rows_share_a_batch_and_each_gets_its_own_argmax(head: torch.nn.Linear) -> None:
    release = threading.Event()
    calls: list[int] = []
    adapters_seen: list[list[str | None]] = []

    def logits(hidden: torch.Tensor, adapters: Sequence[str | None]) -> torch.Tensor:
        calls.append(hidden.shape[0])
        adapters_seen.append(list(adapters))
        release.wait(5)  # the first batch holds the worker until every other row is waiting
        return head(hidden)

    batcher = HeadBatcher(logits)
    rows = [torch.randn(1, 1, D) for _ in range(6)]
    first = asyncio.create_task(batcher.score(rows[0], lambda lg: int(lg.argmax())))
    await eventually(lambda: calls == [1])  # the lone row is computing
    names = [None, "a", None, "b", "a"]  # each row's LoRA adapter reaches the head with its row
    rest = [
        asyncio.create_task(batcher.score(row, lambda lg: int(lg.argmax()), adapter=name))
        for row, name in zip(rows[1:], names, strict=True)
    ]
    await eventually(lambda: batcher.pending == 5)
    release.set()
    results = await asyncio.gather(first, *rest)
    with torch.no_grad():
        assert results == [int(head(row)[0, -1].argmax()) for row in rows]
    assert calls == [1, 5]  # a lone row runs at once; the five that came meanwhile run as one batch
    assert adapters_seen == [[None], names]
    await batcher.close()


async def test_a_failing_row_and_a_cancelled_caller_leave_the_others_untouched(head: torch.nn.Linear) -> None:
    gate, computing = threading.Event(), threading.Event()

    def logits(hidden: torch.Tensor, adapters: Sequence[str | None]) -> torch.Tensor:
        computing.set()
        gate.wait(5)
        return head(hidden)

    def boom(_: torch.Tensor) -> int:
        raise ValueError("bad sampling parameters")

    batcher = HeadBatcher(logits)
    blocker = asyncio.create_task(batcher.score(torch.randn(1, 1, D), lambda lg: 0))
    await eventually(computing.is_set)
    good = asyncio.create_task(batcher.score(torch.randn(1, 1, D), lambda lg: int(lg.argmax())))
    bad = asyncio.create_task(batcher.score(torch.randn(1, 1, D), boom))
    gone = asyncio.create_task(batcher.score(torch.randn(1, 1, D), lambda lg: 1))
    await eventually(lambda: batcher.pending == 3)
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


class _Session:
    """One generation's key for the batcher's forecast (any object that can be weakly referenced)."""


async def _round(batcher: HeadBatcher, sessions: list[_Session], head: torch.nn.Linear) -> list[int]:
    rows = [batcher.score(torch.randn(1, 1, D), lambda lg: int(lg.argmax()), s) for s in sessions]
    return list(await asyncio.gather(*rows))


async def test_a_straggler_waits_for_the_due_group_and_then_steps_with_it(head: torch.nn.Linear) -> None:
    batcher = HeadBatcher(lambda hidden, adapters: head(hidden), merge_window=0.5)
    group = [_Session() for _ in range(4)]
    for _ in range(3):  # every session's rhythm: a row every 100 ms, all together
        await _round(batcher, group, head)
        await asyncio.sleep(0.1)
    straggler = asyncio.create_task(_round(batcher, group[:1], head))  # out of phase: 100 ms early
    await asyncio.sleep(0.1)
    await _round(batcher, group[1:], head)
    await straggler
    assert batcher.batch_sizes[-1] == 4  # ... and it did not cost a batch of its own
    await batcher.close()


async def test_without_a_merge_window_the_straggler_runs_alone(head: torch.nn.Linear) -> None:
    batcher = HeadBatcher(lambda hidden, adapters: head(hidden), merge_window=0.0)
    group = [_Session() for _ in range(4)]
    for _ in range(3):
        await _round(batcher, group, head)
        await asyncio.sleep(0.1)
    await _round(batcher, group[:1], head)
    await asyncio.sleep(0.1)
    await _round(batcher, group[1:], head)
    assert batcher.batch_sizes[-2:] == [1, 3]
    await batcher.close()


async def test_a_finished_session_is_not_waited_for(head: torch.nn.Linear) -> None:
    batcher = HeadBatcher(lambda hidden, adapters: head(hidden), window=5.0, merge_window=5.0)
    sessions = [_Session() for _ in range(4)]
    for _ in range(3):
        await _round(batcher, sessions, head)
        await asyncio.sleep(0.05)
    for ended in sessions[1:]:
        batcher.forget(ended)
    began = asyncio.get_running_loop().time()
    await _round(batcher, sessions[:1], head)
    assert asyncio.get_running_loop().time() - began < 1.0  # the three that ended would be due: no wait for them
    await batcher.close()
