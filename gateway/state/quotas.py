"""Per-key limits — requests per minute, tokens per minute, concurrent streams — as atomic Redis counters.

One Lua script checks every limit and takes the request's share in one step, so N concurrent requests on any
number of replicas never exceed a quota. A request reserves its prompt tokens plus its ``max_tokens`` up front and
gives back what it did not use when it ends.

While Redis is down, each replica enforces ``limit / replicas`` with counters in its own memory: the swarm-wide total
stays bounded by the limit instead of being multiplied by the replica count. ``replicas`` is the larger of
``--replicas`` and the live replicas last counted in Redis (``ReplicaCensus``), so it holds without the flag too.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from gateway.state.api_keys import KeyLimits
from gateway.state.redis_link import RedisDown, RedisLink
from gateway.state.replicas import ReplicaCensus

WINDOW = 60  # seconds: the minute of "per minute"
STREAM_COUNTER_TTL = 3600  # a crashed replica's streams stop counting after this

_ADMIT = """
local rpm, tpm, streams_max, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if rpm > 0 and tonumber(redis.call('GET', KEYS[1]) or '0') + 1 > rpm then return 1 end
if tpm > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') + tokens > tpm then return 2 end
if streams_max > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') + 1 > streams_max then return 3 end
redis.call('INCR', KEYS[1]); redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('INCRBY', KEYS[2], tokens); redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('INCR', KEYS[3]); redis.call('EXPIRE', KEYS[3], ARGV[6])
return 0
"""
_LIMIT_NAMES = {1: "requests per minute", 2: "tokens per minute", 3: "concurrent streams"}


class QuotaExceeded(Exception):
    def __init__(self, limit: str, retry_after: int) -> None:
        super().__init__(f"rate limit reached: {limit}")
        self.limit = limit
        self.retry_after = retry_after


@dataclass
class Ticket:
    """One admitted request's share of its key's quotas, returned by ``QuotaLimiter.release``."""

    key_id: str
    window: int
    tokens: int
    local: bool  # admitted by the in-memory fallback


def _keys(key_id: str, window: int) -> list[str]:
    return [f"sg:rl:{key_id}:req:{window}", f"sg:rl:{key_id}:tok:{window}", f"sg:rl:{key_id}:streams"]


def _window_of(counter: str) -> int | None:
    suffix = counter.rsplit(":", 1)[-1]
    return int(suffix) if suffix.isdigit() else None


class QuotaLimiter:
    def __init__(
        self,
        link: RedisLink,
        replicas: int = 1,
        census: ReplicaCensus | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.link = link
        self.clock = clock  # wall-clock seconds: the windows are calendar minutes, shared by every replica
        self.configured_replicas = max(1, replicas)
        self.census = census
        self._admit = link.client.register_script(_ADMIT)
        self._local: Counter[str] = Counter()

    async def admit(self, key_id: str, limits: KeyLimits, tokens: int) -> Ticket:
        """Take one request, ``tokens`` tokens and one stream from the key's quotas, or raise ``QuotaExceeded``."""
        window = int(self.clock()) // WINDOW
        args = [limits.requests_per_minute or 0, limits.tokens_per_minute or 0, limits.concurrent_streams or 0]
        try:
            verdict = await self.link.run(
                lambda r: self._admit(keys=_keys(key_id, window), args=[*args, tokens, 2 * WINDOW, STREAM_COUNTER_TTL])
            )
            local = False
        except RedisDown:
            verdict = self._admit_locally(key_id, window, args, tokens)
            local = True
        if int(verdict):
            raise QuotaExceeded(_LIMIT_NAMES[int(verdict)], self._retry_after(int(verdict)))
        return Ticket(key_id, window, tokens, local)

    @property
    def replicas(self) -> int:
        """Replicas a quota is split between while Redis is down."""
        return max(self.configured_replicas, self.census.count if self.census else 1)

    def _admit_locally(self, key_id: str, window: int, limits: list[int], tokens: int) -> int:
        requests, token_count, streams = _keys(key_id, window)
        for stale in [name for name in self._local if _window_of(name) not in (None, window)]:
            del self._local[stale]  # past minutes' counts (a late release into them is harmless)
        replicas = self.replicas
        # A limit below the replica count gets a share of 0 here: refused until Redis is back, never unlimited.
        shares = [math.floor(limit / replicas) if limit else None for limit in limits]
        for code, (counter, share, amount) in enumerate(
            ((requests, shares[0], 1), (token_count, shares[1], tokens), (streams, shares[2], 1)), start=1
        ):
            if share is not None and self._local[counter] + amount > share:
                return code
        self._local.update({requests: 1, token_count: tokens, streams: 1})
        return 0

    def _retry_after(self, code: int) -> int:
        if code == 3:
            return 1  # a stream may end any moment
        return WINDOW - int(self.clock()) % WINDOW  # the next minute's window

    async def release(self, ticket: Ticket, used_tokens: int) -> None:
        """The request ended: free its stream and give back the tokens it reserved but did not use."""
        _, token_count, streams = _keys(ticket.key_id, ticket.window)
        unused = max(0, ticket.tokens - used_tokens)
        if ticket.local:
            self._local.subtract({streams: 1, token_count: unused})
            return
        try:

            async def give_back(client: Redis) -> None:
                async with client.pipeline(transaction=True) as pipe:
                    pipe.decr(streams)
                    if unused:
                        pipe.decrby(token_count, unused)
                    await pipe.execute()

            await self.link.run(give_back)
        except RedisDown:
            pass  # the stream counter expires on its own; the tokens stay counted until the window ends
