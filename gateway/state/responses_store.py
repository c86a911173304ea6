"""Stored responses of /v1/responses (``store: true``), in Redis beside the sessions so any replica can read them.

Keys:
    sg:response:{id}   JSON ``StoredResponse``; expires ``ttl`` seconds after its last write

A stored response carries the conversation it ended (chat messages: the earlier turns, this turn's input and its
output, never the instructions) so that a request naming it as ``previous_response_id`` continues from there.

While Redis is down (or with no Redis at all) this replica keeps what it wrote in memory, bounded, and writes it
through when Redis is back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.state.redis_link import RedisDown, RedisLink

logger = logging.getLogger(__name__)

MEMORY_KEPT = 1024  # responses held in memory for reads while Redis is down (the oldest go first)


class StoredResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")

    key_id: str | None  # whose response it is (None: authentication was off)
    response: dict[str, Any]  # the response object as the API returns it
    messages: list[dict[str, Any]] = []  # the conversation so far, as chat messages


class Kept:
    """Responses one WebSocket connection keeps for its own life, ``store: false`` ones among them (never written to
    Redis): the most recent ``limit``, for ``previous_response_id`` on the same socket."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._held: OrderedDict[str, StoredResponse] = OrderedDict()

    def keep(self, response_id: str, stored: StoredResponse) -> None:
        self._held[response_id] = stored
        self._held.move_to_end(response_id)
        while len(self._held) > self.limit:
            self._held.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._held.get(response_id)


def _key(response_id: str) -> str:
    return f"sg:response:{response_id}"


class ResponseStore:
    def __init__(self, link: RedisLink, ttl: float = 86400.0) -> None:
        self.link = link
        self.ttl = ttl
        self._memory: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()  # id -> (expiry, response)
        self._unsynced: set[str] = set()
        link.on_recovery(self._write_through)

    async def save(self, response_id: str, stored: StoredResponse) -> None:
        self._remember(response_id, stored)
        try:
            await self._write(response_id, stored)
            self._unsynced.discard(response_id)
        except RedisDown:
            self._unsynced.add(response_id)

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            raw = await self.link.run(lambda r: r.get(_key(response_id)))
        except RedisDown:
            return self._held(response_id)
        if response_id in self._unsynced:  # written here while Redis was down: newer than what Redis holds
            return self._held(response_id)
        if raw is None:
            return None
        try:
            return StoredResponse.model_validate_json(raw)
        except ValidationError:
            logger.warning("stored response %s is unreadable; ignoring it", response_id)
            return None

    def _held(self, response_id: str) -> StoredResponse | None:
        held = self._memory.get(response_id)
        if held is None or held[0] < time.monotonic():
            return None
        return held[1]

    async def delete(self, response_id: str) -> bool:
        """Forget the response everywhere; whether it existed."""
        existed = self._memory.pop(response_id, None) is not None
        self._unsynced.discard(response_id)
        with contextlib.suppress(RedisDown):
            existed = bool(await self.link.run(lambda r: r.delete(_key(response_id)))) or existed
        return existed

    def _remember(self, response_id: str, stored: StoredResponse) -> None:
        self._memory[response_id] = (time.monotonic() + self.ttl, stored)
        self._memory.move_to_end(response_id)
        while len(self._memory) > MEMORY_KEPT:
            dropped, _ = self._memory.popitem(last=False)
            self._unsynced.discard(dropped)

    async def _write(self, response_id: str, stored: StoredResponse) -> None:
        data = stored.model_dump_json()
        await self.link.run(lambda r: r.set(_key(response_id), data, ex=max(1, int(self.ttl))))

    async def _write_through(self) -> None:
        for response_id in list(self._unsynced):
            held = self._memory.get(response_id)
            if held is not None:
                await self._write(response_id, held[1])
            self._unsynced.discard(response_id)
