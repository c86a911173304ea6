"""The node's KV-cache budget, in tokens: sessions reserve room on open and give it back on close.

Accounting is exact by construction: every reservation is released by the ``async with`` that made it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from shared.errors import CacheFull


class CachePool:
    def __init__(self, total_tokens: int) -> None:
        self.total_tokens = total_tokens
        self._used = 0
        self._sessions = 0
        self._freed = asyncio.Condition()

    @property
    def tokens_left(self) -> int:
        return self.total_tokens - self._used

    @property
    def sessions(self) -> int:
        return self._sessions

    async def wait_until_empty(self) -> None:
        """Return once no session holds room (a draining node waits on this)."""
        async with self._freed:
            await self._freed.wait_for(lambda: self._sessions == 0)

    @asynccontextmanager
    async def reserve(self, tokens: int, wait: float = 0.0) -> AsyncIterator[None]:
        """Hold ``tokens`` of room for the body; waits up to ``wait`` seconds, then raises ``CacheFull``."""
        if tokens > self.total_tokens:
            raise CacheFull(f"{tokens} tokens exceed this node's whole cache of {self.total_tokens}")
        async with self._freed:
            if tokens > self.tokens_left:
                if wait <= 0:
                    raise CacheFull(f"{tokens} tokens asked, {self.tokens_left} free")
                try:
                    await asyncio.wait_for(self._freed.wait_for(lambda: tokens <= self.tokens_left), wait)
                except TimeoutError:
                    raise CacheFull(f"{tokens} tokens asked, {self.tokens_left} free after {wait}s") from None
            self._used += tokens
            self._sessions += 1
        try:
            yield
        finally:
            self._used -= tokens
            self._sessions -= 1
            async with self._freed:
                self._freed.notify_all()
