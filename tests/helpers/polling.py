"""Waiting for a condition in tests: poll it under a deadline, never sleep a guessed time and hope."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(check: Callable[[], bool | Awaitable[bool]], within: float = 30.0, every: float = 0.05) -> None:
    """Until ``check()`` (plain or async) holds; AssertionError naming it after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"{getattr(check, '__name__', check)} did not hold within {within}s")
        await asyncio.sleep(every)


def wait_until(
    check: Callable[[], bool], within: float = 30.0, every: float = 0.1, state: Callable[[], object] | None = None
) -> None:
    """``eventually`` for tests outside an event loop (blocking clients, processes); ``state``: what to show when the
    deadline passes (what was seen instead)."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            seen = "" if state is None else f"; seen: {state()}"
            raise AssertionError(f"{getattr(check, '__name__', check)} did not hold within {within}s{seen}")
        time.sleep(every)
