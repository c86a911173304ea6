"""The one batching primitive: work items of many sessions, gathered into runs that cost about what one item costs.

Under the gateway's LM head (one matmul for many sessions' rows), its step links (one message per node for many
sessions' decode steps), and the node's decode and prefill (one forward for many sessions). Each configures a
``Batcher`` with what one run *does*; the batcher owns the rest:

* **arrivals**: ``enqueue`` queues an item with its caller's future; a worker task starts on the first item and ends
  once nothing waits, so an idle batcher holds no task;
* **rhythm** (optional): before a run, wait for the sessions *due* soon (``ArrivalForecast``), at most about one
  run's duration (``Rhythm.window``), or up to ``Rhythm.merge_window`` while the waiting items are a minority of the
  running sessions; a lone stream never waits;
* **sizes**: ``max_items`` and ``fits`` bound what one run takes (the rest waits for the next), ``group`` splits a run
  into runs of one key each; callers that left are dropped before the run;
* **record**: the running average of a run's duration (the rhythm's wait) and the sizes of recent runs.

A batcher either holds a ``Batcher`` (several per owner: the step links' one per node) or is one, passing its own
run method up (the head, the node's decode and prefill batchers).

``run(jobs)`` settles each job (``Job.resolve`` / ``Job.fail``) — now or later: a step link's replies come back on
their stream — or raises, and every unsettled job of the run fails with that error; the batcher goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from shared.arrival_forecast import ArrivalForecast

RUN_SMOOTHING = 0.2  # weight of the newest run's duration in the running estimate
SIZES_KEPT = 1000  # sizes of recent runs kept (tests, benchmarks); the older half goes when full

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class Job(Generic[Item, Result]):
    item: Item
    future: asyncio.Future[Result]
    session: object | None = None  # the forecast's key: one object per session, weakly held

    @property
    def live(self) -> bool:
        """Nobody settled it yet, and its caller has not left (a cancelled caller cancels the future)."""
        return not self.future.done()

    def resolve(self, value: Result) -> None:
        if not self.future.done():
            self.future.set_result(value)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(frozen=True)
class Rhythm:
    window: float  # seconds a run waits, at most, for due sessions (less: about one run's duration)
    merge_window: float | None = None  # seconds a minority of the running sessions waits for the rest (None: never)


async def wait_for_arrivals(arrival: asyncio.Event, count: Callable[[], int], wanted: int, deadline: float) -> None:
    """Until ``count()`` reaches ``wanted`` or the loop's clock passes ``deadline``; ``arrival`` is set on each one."""
    loop = asyncio.get_running_loop()
    while count() < wanted and (remaining := deadline - loop.time()) > 0:
        arrival.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(remaining):
                await arrival.wait()


class Batcher(Generic[Item, Result]):
    def __init__(
        self,
        run: Callable[[list[Job[Item, Result]]], Awaitable[None]],
        *,
        name: str,
        rhythm: Rhythm | None = None,
        max_items: int | None = None,
        fits: Callable[[list[Item], Item], bool] | None = None,
        group: Callable[[Item], Hashable] | None = None,
    ) -> None:
        self._runner = run
        self.name = name  # the worker task's name
        self.rhythm = rhythm
        self.max_items = max_items
        self._fits = fits  # may ``item`` join the items taken so far? (checked in arrival order)
        self._group = group
        self._waiting: list[Job[Item, Result]] = []
        self._arrival = asyncio.Event()
        self._forecast: ArrivalForecast[object] = ArrivalForecast()
        self._worker: asyncio.Task[None] | None = None
        self.run_seconds: float | None = None  # running average of one run's duration
        self.batch_sizes: list[int] = []  # items of recent runs, newest last

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def enqueue(self, item: Item, session: object | None = None) -> asyncio.Future[Result]:
        """Queue ``item``; its future settles when a run has computed it (cancel the future to withdraw it)."""
        loop = asyncio.get_running_loop()
        if session is not None and self.rhythm is not None:
            self._forecast.arrived(session, loop.time())
        job: Job[Item, Result] = Job(item, loop.create_future(), session)
        self._waiting.append(job)
        self._arrival.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work(), name=self.name)
        return job.future

    async def submit(self, item: Item, session: object | None = None) -> Result:
        return await self.enqueue(item, session)

    def forget(self, session: object) -> None:
        """``session`` ended: no run waits for it any more."""
        self._forecast.forget(session)

    def stop(self) -> None:
        """Cancel the worker and every waiting job."""
        if self._worker is not None:
            self._worker.cancel()
        waiting, self._waiting = self._waiting, []
        for job in waiting:
            job.future.cancel()

    async def close(self) -> None:
        self.stop()
        if self._worker is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    async def _work(self) -> None:
        while self._waiting:
            if self.rhythm is not None:
                await self._wait_for_due(self.rhythm)
            taken = self._take()
            for jobs in self._split(taken):
                await self._run_once(jobs)

    async def _wait_for_due(self, rhythm: Rhythm) -> None:
        now = asyncio.get_running_loop().time()
        present = {job.session for job in self._waiting if job.session is not None}
        if rhythm.merge_window is not None and 2 * len(self._waiting) < self._forecast.running(now):
            # a minority of the running sessions: the rest may be worth a longer wait
            deadline = now + rhythm.merge_window
        else:
            deadline = now + min(rhythm.window, self.run_seconds or rhythm.window)
        wanted = len(self._waiting) + self._forecast.due(now, deadline, present)
        if self.max_items is not None:
            wanted = min(wanted, self.max_items)
        await wait_for_arrivals(self._arrival, lambda: len(self._waiting), wanted, deadline)

    def _take(self) -> list[Job[Item, Result]]:
        """The next run's live jobs in arrival order: the first, and those after it within ``max_items`` and ``fits``;
        the rest keep waiting."""
        taken: list[Job[Item, Result]] = []
        rest: list[Job[Item, Result]] = []
        for job in self._waiting:
            if not job.live:
                continue
            full = self.max_items is not None and len(taken) >= self.max_items
            if taken and (full or (self._fits is not None and not self._fits([t.item for t in taken], job.item))):
                rest.append(job)
            else:
                taken.append(job)
        self._waiting = rest
        return taken

    def _split(self, jobs: list[Job[Item, Result]]) -> list[list[Job[Item, Result]]]:
        if self._group is None:
            return [jobs] if jobs else []
        groups: dict[Hashable, list[Job[Item, Result]]] = {}
        for job in jobs:
            groups.setdefault(self._group(job.item), []).append(job)
        return list(groups.values())

    async def _run_once(self, jobs: list[Job[Item, Result]]) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            await self._runner(jobs)
        except Exception as error:  # the run failed: every job in it fails the same way; the batcher goes on
            for job in jobs:
                job.fail(error)
            return
        except BaseException:  # cancelled (closed, or the loop is shutting down): nobody may wait forever
            for job in jobs:
                job.fail(RuntimeError(f"{self.name} stopped"))
            raise
        took = loop.time() - began
        if self.run_seconds is not None:
            took = (1 - RUN_SMOOTHING) * self.run_seconds + RUN_SMOOTHING * took
        self.run_seconds = took
        self.batch_sizes.append(len(jobs))
        if len(self.batch_sizes) > SIZES_KEPT:
            del self.batch_sizes[: SIZES_KEPT // 2]
