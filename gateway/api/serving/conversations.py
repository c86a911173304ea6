"""The Conversations API over ``ConversationStore``: create, read, update and delete conversations and their items,
each visible to the API key that made it (every key, for an admin), and the two steps a response takes with one:
its items as the context, then its input and output appended."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from gateway.api.auth import Caller
from gateway.api.errors import InvalidRequest, NotFound, ServiceUnavailable
from gateway.api.protocol.conversations import Conversation, ConversationCreate, DeletedConversation, ItemList
from gateway.api.protocol.responses import InputItem, item_id
from gateway.state.conversations_store import ConversationRecord, ConversationStore, Item
from gateway.state.redis_link import RedisDown

_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "compaction": "cmp"}


class ConversationServing:
    def __init__(self, store: ConversationStore) -> None:
        self.store = store

    async def create(self, body: ConversationCreate, caller: Caller) -> Conversation:
        record = ConversationRecord(id=f"conv_{uuid.uuid4().hex}", key_id=caller.key_id, metadata=body.metadata or {})
        async with _redis():
            await self.store.save(record)
            await self.store.append(record.id, [stored_item(item) for item in body.items or []])
        return _shown(record)

    async def retrieve(self, conversation_id: str, caller: Caller) -> Conversation:
        return _shown(await self.visible(conversation_id, caller))

    async def update(self, conversation_id: str, metadata: dict[str, str], caller: Caller) -> Conversation:
        record = (await self.visible(conversation_id, caller)).model_copy(update={"metadata": metadata})
        async with _redis():
            await self.store.save(record)
        return _shown(record)

    async def delete(self, conversation_id: str, caller: Caller) -> DeletedConversation:
        await self.visible(conversation_id, caller)
        async with _redis():
            await self.store.delete(conversation_id)
        return DeletedConversation(id=conversation_id)

    async def add_items(self, conversation_id: str, items: list[InputItem], caller: Caller) -> ItemList:
        await self.visible(conversation_id, caller)
        stored = [stored_item(item) for item in items]
        async with _redis():
            await self.store.append(conversation_id, stored)
        return page(stored, len(stored), has_more=False)

    async def list_items(
        self, conversation_id: str, caller: Caller, limit: int, order: Literal["asc", "desc"], after: str | None
    ) -> ItemList:
        items = await self.items(conversation_id, caller)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidRequest(f"No item with id {after!r} in this conversation.", "invalid_value", "after")
            items = items[ids.index(after) + 1 :]
        return page(items[:limit], limit, has_more=len(items) > limit)

    async def item(self, conversation_id: str, item: str, caller: Caller) -> dict[str, Any]:
        for found in await self.items(conversation_id, caller):
            if found["id"] == item:
                return found
        raise NotFound(f"Item with id {item!r} not found.", "item_not_found", "item_id")

    async def delete_item(self, conversation_id: str, item: str, caller: Caller) -> Conversation:
        record = await self.visible(conversation_id, caller)
        async with _redis():
            removed = await self.store.remove(conversation_id, item)
        if not removed:
            raise NotFound(f"Item with id {item!r} not found.", "item_not_found", "item_id")
        return _shown(record)

    async def items(self, conversation_id: str, caller: Caller, param: str = "conversation_id") -> list[Item]:
        await self.visible(conversation_id, caller, param)
        async with _redis():
            return await self.store.items(conversation_id)

    async def append(self, conversation_id: str, items: list[Item]) -> None:
        async with _redis():
            await self.store.append(conversation_id, items)

    async def visible(self, conversation_id: str, caller: Caller, param: str = "conversation_id") -> ConversationRecord:
        async with _redis():
            record = await self.store.get(conversation_id)
        if record is None or not (caller.admin or record.key_id == caller.key_id):
            raise NotFound(f"Conversation with id {conversation_id!r} not found.", "conversation_not_found", param)
        return record


def stored_item(item: InputItem) -> Item:
    """An input item as a conversation keeps it: with an id and a status, a message's text as content parts."""
    data = item.model_dump(exclude_none=True)
    data.setdefault("type", "message")
    data.setdefault("id", item_id(_PREFIXES.get(data["type"], "item")))
    data.setdefault("status", "completed")
    if data["type"] == "message" and isinstance(data.get("content"), str):
        kind = "output_text" if data.get("role") == "assistant" else "input_text"
        data["content"] = [{"type": kind, "text": data["content"]}]
    return data


def page(items: list[Item], limit: int, has_more: bool) -> ItemList:
    first = items[0]["id"] if items else None
    last = items[-1]["id"] if items else None
    return ItemList(data=items[:limit], first_id=first, last_id=last, has_more=has_more)


def _shown(record: ConversationRecord) -> Conversation:
    return Conversation(id=record.id, created_at=record.created_at, metadata=record.metadata)


@contextlib.asynccontextmanager
async def _redis() -> AsyncIterator[None]:
    """Redis configured but unreachable: 503 (a conversation is shared state; no replica may fork it)."""
    try:
        yield
    except RedisDown as exc:
        raise ServiceUnavailable(
            "Conversations are unavailable right now (Redis is down); retry shortly.", "conversations_unavailable"
        ) from exc
