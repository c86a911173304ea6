"""How many gateway replicas share this Redis, counted while Redis is up, remembered for while it is down.

Each replica refreshes its own member of ``sg:gateways`` (a sorted set scored by the time of its last beat) every
``BEAT_PERIOD`` seconds; members older than ``EXPIRY`` are dropped. ``count`` is the larger of the configured
``--replicas`` and the most replicas seen live at the last successful beat, so a deployment that forgot
``--replicas`` still splits its quotas when Redis goes down instead of multiplying them.
"""

from __future__ import annotations

import contextlib
import logging
import time

from redis.asyncio import Redis

from gateway.state.redis_link import RedisDown, RedisLink
from shared.background import Periodic

logger = logging.getLogger(__name__)

CENSUS_KEY = "sg:gateways"
BEAT_PERIOD = 5.0  # seconds between a replica's heartbeats
EXPIRY = 30.0  # seconds without a beat after which a replica no longer counts (it crashed or scaled away)


class ReplicaCensus:
    def __init__(self, link: RedisLink, replica: str, configured: int = 1) -> None:
        self.link = link
        self.replica = replica
        self.configured = max(1, configured)
        self.seen = 1  # live replicas at the last successful beat, this one included
        self._beats = Periodic("replica-census", BEAT_PERIOD, self._beat_unless_down, immediate=True)

    @property
    def count(self) -> int:
        return max(self.configured, self.seen)

    async def beat(self) -> None:
        """Refresh this replica's entry and count the live ones (raises ``RedisDown``)."""
        now = time.time()

        async def write(client: Redis) -> int:
            async with client.pipeline(transaction=True) as pipe:
                pipe.zadd(CENSUS_KEY, {self.replica: now})
                pipe.zremrangebyscore(CENSUS_KEY, "-inf", now - EXPIRY)
                pipe.zcard(CENSUS_KEY)
                pipe.expire(CENSUS_KEY, int(EXPIRY * 2))
                results = await pipe.execute()
            return int(results[2])

        seen = await self.link.run(write)
        if seen != self.seen and seen > self.configured:
            logger.info("%d gateway replicas share Redis (--replicas %d)", seen, self.configured)
        self.seen = max(1, seen)

    def start(self) -> None:
        if self.link.enabled:
            self._beats.start()

    async def _beat_unless_down(self) -> None:
        with contextlib.suppress(RedisDown):
            await self.beat()

    async def close(self) -> None:
        await self._beats.stop()
        with contextlib.suppress(RedisDown):
            await self.link.run(lambda r: r.zrem(CENSUS_KEY, self.replica))  # leaving: stop counting at once
