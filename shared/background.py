"""Background tasks of both processes: a job run every few seconds, and the one way to stop a task.

Every loop that wakes up periodically (probing, announcing, expiring, sweeping, watching) is a ``Periodic``; every
shutdown of a task is ``stop_task`` (cancel, then wait until its own cleanup has run), so none of them is written by
hand and none leaves a task running or an exception unretrieved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has finished; a no-op for None or a finished task.

    ``asyncio.wait`` rather than awaiting the task: the task's own cancellation (or error) is not ours to raise,
    while a cancellation of the caller still propagates."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: an error during its cleanup was logged by the task or does not matter now


class Periodic:
    """``tick`` every ``period`` seconds (after the first wait, or at once with ``immediate``) until stopped.

    A tick that raises is logged as a warning with ``failure`` and the loop goes on; ``period`` may be a callable
    read before each wait (a setting that changes)."""

    def __init__(
        self,
        name: str,
        period: float | Callable[[], float],
        tick: Callable[[], Awaitable[object]],
        failure: str | None = None,
        immediate: bool = False,
    ) -> None:
        self.name = name
        self._period = period
        self._tick = tick
        self._failure = failure or f"{name} failed"
        self._immediate = immediate
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if not self.running:
            self._task = asyncio.create_task(self._run(), name=self.name)

    def cancel(self) -> None:
        """Stop without waiting (for a synchronous shutdown path)."""
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        await stop_task(self._task)

    async def _run(self) -> None:
        if not self._immediate:
            await asyncio.sleep(self._seconds())
        while True:
            try:
                await self._tick()
            except Exception:
                logger.warning("%s; again in %.1fs", self._failure, self._seconds(), exc_info=True)
            await asyncio.sleep(self._seconds())

    def _seconds(self) -> float:
        return self._period() if callable(self._period) else self._period
