"""The node's KV-cache budget, in tokens: sessions take an allocation when they open and give it back when they end.

Accounting is exact by construction: ``used`` is the sum of the live allocations, an allocation is counted the moment
it is granted (no ``await`` between the check and the grant) and released at most once (``Allocation.release`` is
idempotent), whoever releases it — the session's close, its stream's end, the idle reaper, or a cancelled open.
A live allocation may be resized: growing is granted like a new allocation of the difference, shrinking gives the
difference back at once.

A request that does not fit either fails at once with ``CacheFull`` (retryable: the router tries another node) or,
when the caller sends an allocation timeout, waits for room up to that long and then fails the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from shared.errors import CacheFull


class Allocation:
    """Room for ``tokens`` tokens, held until ``release``."""

    def __init__(self, pool: CachePool, tokens: int) -> None:
        self.pool = pool
        self.tokens = tokens
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._give_back(self.tokens)


class CachePool:
    def __init__(self, total_tokens: int) -> None:
        if total_tokens <= 0:
            raise ValueError(f"a cache pool needs room for at least one token, got {total_tokens}")
        self.total_tokens = total_tokens
        self._used = 0
        self._sessions = 0
        self._waiters: list[asyncio.Future[None]] = []  # woken on every release; each re-checks its own request

    @property
    def tokens_left(self) -> int:
        return self.total_tokens - self._used

    @property
    def sessions(self) -> int:
        """Live allocations (open sessions and stateless forwards in flight)."""
        return self._sessions

    async def allocate(self, tokens: int, wait: float = 0.0) -> Allocation:
        """Grant ``tokens`` of room; waits up to ``wait`` seconds for it, then raises ``CacheFull``."""
        if tokens <= 0:
            raise ValueError(f"allocate a positive number of tokens, not {tokens}")
        await self._wait_for_room(tokens, tokens, wait)
        self._used += tokens
        self._sessions += 1
        return Allocation(self, tokens)

    async def resize(self, allocation: Allocation, tokens: int, wait: float = 0.0) -> None:
        """Make a live ``allocation`` hold ``tokens``: more is granted like ``allocate`` (same wait, same refusal),
        less is given back at once. Raises ``ValueError`` if the allocation was released (even while waiting)."""
        if tokens <= 0:
            raise ValueError(f"resize to a positive number of tokens, not {tokens}")
        if allocation.pool is not self or allocation.released:
            raise ValueError("resize a live allocation of this pool")
        extra = tokens - allocation.tokens
        if extra > 0:
            await self._wait_for_room(extra, tokens, wait)
            if allocation.released:  # its session ended while this waited for room
                raise ValueError("the allocation was released while it waited for room")
        self._used += extra
        allocation.tokens = tokens
        if extra < 0:
            self._wake_waiters()

    async def _wait_for_room(self, tokens: int, whole: int, wait: float) -> None:
        """Return once ``tokens`` are free (the caller grants them with no ``await`` in between), or raise
        ``CacheFull``; ``whole``, the allocation's size once granted, is refused at once if it can never fit."""
        if whole > self.total_tokens:
            raise CacheFull(f"{whole} tokens exceed this node's whole cache of {self.total_tokens}")
        deadline = asyncio.get_running_loop().time() + wait
        while tokens > self.tokens_left:  # re-checked after every wake-up: another request may have taken the room
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                waited = f" after waiting {wait}s" if wait > 0 else ""
                raise CacheFull(f"{tokens} tokens asked, {self.tokens_left} free{waited}")
            with contextlib.suppress(TimeoutError):  # then the loop's check raises with the final count
                async with asyncio.timeout(remaining):
                    await self._next_release()

    @asynccontextmanager
    async def reserve(self, tokens: int, wait: float = 0.0) -> AsyncIterator[Allocation]:
        """Hold ``tokens`` of room for the body of an ``async with``."""
        allocation = await self.allocate(tokens, wait)
        try:
            yield allocation
        finally:
            allocation.release()

    async def wait_until_empty(self) -> None:
        """Return once no allocation is live (a draining node waits on this)."""
        while self._sessions:
            await self._next_release()

    async def _next_release(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _give_back(self, tokens: int) -> None:
        self._used -= tokens
        self._sessions -= 1
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
