"""race(): work against stop signals — the result, or the work cancelled (its cleanup done) and the reason raised."""

from __future__ import annotations

import asyncio
from typing import NoReturn, cast

import pytest

from gateway.api.serving.stop_signals import Signal, SignalReturned, race, when, when_set


class Left(Exception):
    pass


async def never() -> NoReturn:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_the_work_result_when_no_signal_fires() -> None:
    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await race(work(), never) == 7


async def test_a_signal_cancels_the_work_after_its_cleanup_and_raises_its_reason() -> None:
    stop, cleaned = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        try:
            stop.set()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that awaits (closing node sessions) is waited for
            cleaned.set()

    with pytest.raises(Left):
        await race(work(), never, when_set(stop, Left))
    assert cleaned.is_set()


async def test_finished_work_wins_a_tie() -> None:
    stop = asyncio.Event()

    async def work() -> str:
        stop.set()
        return "done"

    assert await race(work(), when_set(stop, Left)) == "done"


async def test_the_works_own_failure_is_raised() -> None:
    async def work() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await race(work(), never)


async def test_cancelling_the_race_cancels_the_work_and_the_signals() -> None:
    started, cancelled = asyncio.Event(), []

    async def work() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("work")
            raise

    async def signal() -> NoReturn:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("signal")
            raise
        raise AssertionError("unreachable")

    task = asyncio.create_task(race(work(), signal))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == ["signal", "work"]


async def test_a_signal_that_returns_without_a_reason_is_a_bug() -> None:
    async def quiet() -> None:
        return None

    with pytest.raises(SignalReturned):
        await race(asyncio.Event().wait(), cast(Signal, quiet))


async def test_when_fires_after_its_waiter_returns() -> None:
    with pytest.raises(Left):
        await race(asyncio.Event().wait(), when(lambda: asyncio.sleep(0), Left))
