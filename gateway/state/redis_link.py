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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from shared.background import stop_task

logger = logging.getLogger(__name__)

T = TypeVar("T")

SOCKET_TIMEOUT = 0.5  # seconds: the most a request can lose to a frozen Redis
RECHECK_PERIOD = 1.0
MAX_CONNECTIONS = 256


class RedisDown(Exception):
    """Redis did not answer; the caller serves from memory."""


class RedisLink:
    def __init__(self, url: str | None) -> None:
        """``url`` None: no Redis at all (one replica, everything in memory); every call raises ``RedisDown``."""
        self.url = url or "memory"
        self.enabled = url is not None
        # The client connects lazily: for a disabled link it is never used (scripts register without I/O). A
        # blocking pool: hundreds of concurrent sessions queue for a connection (up to the socket timeout) instead
        # of failing with "too many connections", which would read as Redis being down.
        pool = aioredis.BlockingConnectionPool.from_url(
            url or "redis://127.0.0.1:6379/0",
            max_connections=MAX_CONNECTIONS,
            timeout=SOCKET_TIMEOUT,
            socket_timeout=SOCKET_TIMEOUT,
            socket_connect_timeout=SOCKET_TIMEOUT,
            # A pooled connection to a Redis that restarted is dead; one retry on a fresh connection tells that
            # apart from Redis being down. Timeouts are not retried: a frozen Redis costs one socket timeout.
            retry_on_error=[RedisConnectionError],
            decode_responses=True,
        )
        self.client: aioredis.Redis = aioredis.Redis(connection_pool=pool)
        self.up = self.enabled
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
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # redis-py may turn a cancellation that hit mid-command into a connection error; swallowing it
                # would leave the cancelled task running (a loop around this call would never stop).
                raise asyncio.CancelledError from exc
            self._mark_down(exc)
            raise RedisDown(self.url) from exc

    @property
    def state(self) -> str:
        """ "up", "down" (serving from memory until it is back) or "disabled" (no Redis configured)."""
        if not self.enabled:
            return "disabled"
        return "up" if self.up else "down"

    async def probe(self) -> bool:
        """Whether Redis answers now (logs a warning and starts the watcher if not)."""
        with contextlib.suppress(RedisDown):
            await self.run(lambda r: r.ping())
        return self.up

    def _mark_down(self, exc: BaseException) -> None:
        if self.up and self.enabled:
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
        await stop_task(self._watcher)
        await self.client.aclose()
        await self.client.connection_pool.disconnect()
