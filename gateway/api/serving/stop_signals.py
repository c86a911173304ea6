"""One way to stop work early: race it against stop signals.

A *signal* is a coroutine function that completes only by raising the reason to stop (the client left, the session
was cancelled). ``race(work, *signals)`` returns ``work``'s result, or — when a signal fires first — cancels
``work``, waits for its cleanup (so a generation's ``finally`` has closed its node sessions) and raises the
signal's reason. Work that finished wins a tie.

    race(gather(), client_left(receive), live.cancelled)   # a non-streamed request
    race(pump(chunks), live.cancelled)                     # a session's producer
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

# Completes only by raising why the work must stop.
Signal = Callable[[], Coroutine[Any, Any, NoReturn]]


class SignalReturned(RuntimeError):
    """A signal completed without saying why (a bug in that signal)."""


async def race(work: Awaitable[T], *signals: Signal) -> T:
    """``work``'s result, unless a signal fires first: then ``work`` is cancelled and the signal's reason raised."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(signal()) for signal in signals]
    try:
        done, _ = await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        fired = next(watcher for watcher in watchers if watcher in done)
        fired.result()  # raises the reason
        raise SignalReturned("a stop signal completed without a reason")
    finally:
        for pending in (task, *watchers):
            pending.cancel()
        await asyncio.gather(task, *watchers, return_exceptions=True)


def when(waiter: Callable[[], Awaitable[object]], reason: Callable[[], BaseException]) -> Signal:
    """A signal that fires when ``waiter()`` returns, raising ``reason()``."""

    async def fire() -> NoReturn:
        await waiter()
        raise reason()

    return fire


def when_set(event: asyncio.Event, reason: Callable[[], BaseException]) -> Signal:
    """A signal that fires once ``event`` is set, raising ``reason()``."""
    return when(event.wait, reason)
