"""The batching primitive alone: arrivals, sizes, groups, failures and the rhythm's wait, with a run function that
records what it was given (the batchers built on it have their own tests with real models)."""

from __future__ import annotations

import asyncio

import pytest

from shared.batching import Batcher, Job, Rhythm


class Recorder:
    """A run that doubles each item; with ``hold``, every run waits until ``gate`` is set."""

    def __init__(self, hold: bool = False) -> None:
        self.runs: list[list[int]] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        if not hold:
            self.gate.set()

    async def __call__(self, jobs: list[Job[int, int]]) -> None:
        self.runs.append([job.item for job in jobs])
        self.started.set()
        await self.gate.wait()
        for job in jobs:
            job.resolve(2 * job.item)


async def running(name: str) -> tuple[Batcher[int, int], Recorder, asyncio.Future[int]]:
    """A batcher whose first run (of item 1) is under way, held until ``recorder.gate`` is set."""
    run = Recorder(hold=True)
    batcher: Batcher[int, int] = Batcher(run, name=name)
    first = batcher.enqueue(1)
    await run.started.wait()
    return batcher, run, first


class Session:
    """A forecast key (weakly referenced)."""


async def test_a_lone_item_runs_at_once_and_those_that_come_meanwhile_run_together() -> None:
    batcher, run, first = await running("test")
    rest = [batcher.enqueue(item) for item in (2, 3, 4)]
    assert batcher.pending == 3
    run.gate.set()
    assert await asyncio.gather(first, *rest) == [2, 4, 6, 8]
    assert run.runs == [[1], [2, 3, 4]]
    assert batcher.batch_sizes == [1, 3]


async def test_max_items_fits_and_groups_shape_the_runs() -> None:
    run = Recorder()
    capped: Batcher[int, int] = Batcher(run, name="capped", max_items=2)
    await asyncio.gather(*(capped.enqueue(item) for item in range(5)))
    assert run.runs == [[0, 1], [2, 3], [4]]

    run = Recorder()  # fits: the sum of a run stays within 5; the first item always runs, however large
    bounded: Batcher[int, int] = Batcher(run, name="bounded", fits=lambda taken, item: sum(taken) + item <= 5)
    await asyncio.gather(*(bounded.enqueue(item) for item in (9, 2, 4, 3, 1)))
    assert run.runs == [[9], [2, 3], [4, 1]]

    run = Recorder()
    grouped: Batcher[int, int] = Batcher(run, name="grouped", group=lambda item: item % 2)
    await asyncio.gather(*(grouped.enqueue(item) for item in range(5)))
    assert run.runs == [[0, 2, 4], [1, 3]]
    assert grouped.batch_sizes == [3, 2]


async def test_a_failed_run_fails_its_jobs_only_and_a_cancelled_caller_is_not_run() -> None:
    gate, started = asyncio.Event(), asyncio.Event()
    runs: list[list[int]] = []

    async def run(jobs: list[Job[int, int]]) -> None:
        runs.append([job.item for job in jobs])
        started.set()
        await gate.wait()
        if any(job.item < 0 for job in jobs):
            raise ValueError("negative")
        for job in jobs:
            job.resolve(job.item)

    batcher: Batcher[int, int] = Batcher(run, name="test")
    blocker = batcher.enqueue(0)
    await started.wait()
    bad, gone = batcher.enqueue(-1), batcher.enqueue(7)
    gone.cancel()
    gate.set()
    assert await blocker == 0
    with pytest.raises(ValueError, match="negative"):
        await bad
    assert runs == [[0], [-1]]
    assert await batcher.submit(5) == 5  # the batcher goes on after a failed run


async def test_close_cancels_waiting_jobs_and_fails_the_running_ones() -> None:
    batcher, _, first = await running("closing")
    waiting = batcher.enqueue(2)
    await batcher.close()
    assert waiting.cancelled()
    with pytest.raises(RuntimeError, match="closing stopped"):
        await first


async def test_the_rhythm_waits_for_due_sessions_and_never_for_forgotten_ones() -> None:
    run = Recorder()
    batcher: Batcher[int, int] = Batcher(run, name="rhythm", rhythm=Rhythm(window=5.0, merge_window=5.0))
    early, late = Session(), [Session(), Session()]
    for _ in range(3):  # the three sessions step together every 20 ms
        await asyncio.gather(batcher.submit(1, early), *(batcher.submit(2, s) for s in late))
        await asyncio.sleep(0.02)
    first = batcher.enqueue(1, early)
    await asyncio.sleep(0.01)  # the other two are due, and one of three is a minority: the run waits for them
    rest = [batcher.enqueue(2, s) for s in late]
    assert await asyncio.gather(first, *rest) == [2, 4, 4]
    assert batcher.batch_sizes[-1] == 3

    await asyncio.sleep(0.02)
    for ended in late:
        batcher.forget(ended)
    done = asyncio.Event()
    lone = batcher.enqueue(1, early)
    lone.add_done_callback(lambda _: done.set())
    await asyncio.wait_for(done.wait(), 2.0)  # far less than the 5 s windows: nobody else is due
    assert batcher.batch_sizes[-1] == 1
