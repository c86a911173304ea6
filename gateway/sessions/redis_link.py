"""One Redis connection for the gateway, and what happens when Redis is down.

Every call goes through ``RedisLink.run`` with short socket timeouts. A failure marks Redis down (logged once) and
raises ``RedisDown``; callers then fall back to what they hold in memory. While down, calls fail fast without
touching the network, and a watcher pings Redis every second; when it answers again, the recovery callbacks write
through what was held meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

T = TypeVar("T")

SOCKET_TIMEOUT = 0.5  # seconds: the most a request can lose to a frozen Redis
RECHECK_PERIOD = 1.0


class RedisDown(Exception):
    """Redis did not answer; the caller serves from memory."""


class RedisLink:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT, decode_responses=True
        )
        self.up = True
        self._recovery: list[Callable[[], Awaitable[None]]] = []
        self._watcher: asyncio.Task[None] | None = None

    def on_recovery(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._recovery.append(callback)

    async def run(self, operation: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        if not self.up:
            raise RedisDown(self.url)
        try:
            return await operation(self.client)
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc)
            raise RedisDown(self.url) from exc

    def _mark_down(self, exc: BaseException) -> None:
        if self.up:
            self.up = False
            logger.warning("Redis at %s is down (%s); serving from memory until it is back", self.url, exc)
            self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RECHECK_PERIOD)
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                if await self.client.ping():
                    break
        self.up = True
        logger.warning("Redis at %s is back; writing through what was held in memory", self.url)
        for callback in self._recovery:
            try:
                await callback()
            except RedisDown:
                return  # down again: the next watcher retries
            except Exception:
                logger.exception("write-through after Redis recovery failed")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.client.aclose()
