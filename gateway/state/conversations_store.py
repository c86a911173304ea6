"""Conversations (OpenAI's Conversations API) in Redis, so that every gateway replica reads and extends the same ones.

Keys (``ttl`` seconds after the last write, refreshed on each):
    sg:conversation:{id}          JSON ``ConversationRecord`` (owner, creation time, metadata)
    sg:conversation:{id}:order    list of item ids, oldest first
    sg:conversation:{id}:items    hash item id -> the item as JSON

With no Redis at all (``--redis-url`` unset: one replica) they live in this process's memory. With Redis configured
but down, calls raise ``RedisDown``: a conversation is shared state, and a replica's private copy would fork it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.state.redis_link import RedisLink

Item = dict[str, Any]


class ConversationRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    key_id: str | None  # whose conversation it is (None: authentication was off)
    created_at: int = Field(default_factory=lambda: int(time.time()))
    metadata: dict[str, str] = {}


def _key(conversation_id: str, part: str = "") -> str:
    return f"sg:conversation:{conversation_id}{part}"


class ConversationStore:
    def __init__(self, link: RedisLink, ttl: float = 30 * 86400.0) -> None:
        self.link = link
        self.ttl = max(1, int(ttl))
        self._records: dict[str, ConversationRecord] = {}  # without Redis only
        self._items: dict[str, OrderedDict[str, Item]] = {}

    async def save(self, record: ConversationRecord) -> None:
        if not self.link.enabled:
            self._records[record.id] = record
            self._items.setdefault(record.id, OrderedDict())
            return
        data = record.model_dump_json()
        await self.link.run(lambda r: r.set(_key(record.id), data, ex=self.ttl))

    async def get(self, conversation_id: str) -> ConversationRecord | None:
        if not self.link.enabled:
            return self._records.get(conversation_id)
        raw = await self.link.run(lambda r: r.get(_key(conversation_id)))
        return None if raw is None else ConversationRecord.model_validate_json(raw)

    async def delete(self, conversation_id: str) -> None:
        if not self.link.enabled:
            self._records.pop(conversation_id, None)
            self._items.pop(conversation_id, None)
            return
        keys = [_key(conversation_id, part) for part in ("", ":order", ":items")]
        await self.link.run(lambda r: r.delete(*keys))

    async def append(self, conversation_id: str, items: list[Item]) -> None:
        if not self.link.enabled:
            self._items.setdefault(conversation_id, OrderedDict()).update((item["id"], item) for item in items)
            return
        order, table = _key(conversation_id, ":order"), _key(conversation_id, ":items")

        async def write(r: Any) -> None:
            async with r.pipeline(transaction=True) as pipe:
                pipe.rpush(order, *[item["id"] for item in items])
                pipe.hset(table, mapping={item["id"]: json.dumps(item) for item in items})
                for key in (_key(conversation_id), order, table):
                    pipe.expire(key, self.ttl)
                await pipe.execute()

        if items:
            await self.link.run(write)

    async def items(self, conversation_id: str) -> list[Item]:
        """Every item, oldest first."""
        if not self.link.enabled:
            return list(self._items.get(conversation_id, {}).values())
        order, table = _key(conversation_id, ":order"), _key(conversation_id, ":items")
        ids = await self.link.run(lambda r: r.lrange(order, 0, -1))
        if not ids:
            return []
        raws = await self.link.run(lambda r: r.hmget(table, ids))
        return [json.loads(raw) for raw in raws if raw is not None]

    async def remove(self, conversation_id: str, item_id: str) -> bool:
        """Drop one item; whether it was there."""
        if not self.link.enabled:
            return self._items.get(conversation_id, OrderedDict()).pop(item_id, None) is not None
        order, table = _key(conversation_id, ":order"), _key(conversation_id, ":items")
        removed = await self.link.run(lambda r: r.hdel(table, item_id))
        await self.link.run(lambda r: r.lrem(order, 0, item_id))
        return bool(removed)
