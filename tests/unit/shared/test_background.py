"""The periodic job and the task stop that every background loop of both processes uses."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shared.background import Periodic, stop_task


async def test_a_periodic_job_ticks_again_after_a_tick_that_raises(caplog: pytest.LogCaptureFixture) -> None:
    ticks: list[int] = []
    third = asyncio.Event()

    async def tick() -> None:
        ticks.append(len(ticks))
        if len(ticks) == 1:
            raise RuntimeError("boom")
        if len(ticks) == 3:
            third.set()

    job = Periodic("test-job", 0.001, tick, "the test job failed")
    with caplog.at_level(logging.WARNING, logger="shared.background"):
        job.start()
        await asyncio.wait_for(third.wait(), 10)
        await job.stop()
    assert ticks[:3] == [0, 1, 2]
    assert any("the test job failed" in record.getMessage() for record in caplog.records)
    assert not job.running


async def test_immediate_ticks_before_the_first_wait() -> None:
    ticked = asyncio.Event()

    async def tick() -> None:
        ticked.set()

    job = Periodic("now", 3600.0, tick, immediate=True)
    job.start()
    await asyncio.wait_for(ticked.wait(), 10)
    await job.stop()


async def test_stop_waits_for_the_tasks_own_cleanup() -> None:
    cleaned = asyncio.Event()
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # cleanup that itself awaits
            cleaned.set()

    task = asyncio.create_task(work())
    await started.wait()
    await stop_task(task)
    assert cleaned.is_set() and task.done()


async def test_a_cancelled_caller_of_stop_task_stays_cancelled() -> None:
    """Cancelling the stopper is not swallowed as if it were the stopped task's own cancellation."""
    release = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await release.wait()  # its cleanup takes a while

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(stop_task(task))
    await asyncio.sleep(0.01)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    release.set()
    await asyncio.wait([task])


async def test_stop_task_of_none_or_a_finished_task_is_a_no_op() -> None:
    await stop_task(None)

    async def fails() -> None:
        raise ValueError("already failed")

    task = asyncio.create_task(fails())
    await asyncio.wait([task])
    await stop_task(task)  # the error is retrieved, not raised
