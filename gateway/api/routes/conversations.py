"""/v1/conversations and their items (OpenAI's Conversations API), kept in Redis."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from gateway.api.auth import CallerDep
from gateway.api.dependencies import ResponsesDep
from gateway.api.openapi_docs import errors
from gateway.api.protocol.conversations import (
    Conversation,
    ConversationCreate,
    ConversationUpdate,
    DeletedConversation,
    ItemList,
    ItemsCreate,
)

router = APIRouter(responses=errors(400, 401, 404, 503))

# The conversations' serving object hangs off the responses' (responses read and extend conversations).


@router.post("/v1/conversations")
async def create_conversation(body: ConversationCreate, caller: CallerDep, serving: ResponsesDep) -> Conversation:
    return await serving.conversations.create(body, caller)


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, caller: CallerDep, serving: ResponsesDep) -> Conversation:
    return await serving.conversations.retrieve(conversation_id, caller)


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(
    conversation_id: str, body: ConversationUpdate, caller: CallerDep, serving: ResponsesDep
) -> Conversation:
    return await serving.conversations.update(conversation_id, body.metadata, caller)


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, caller: CallerDep, serving: ResponsesDep) -> DeletedConversation:
    return await serving.conversations.delete(conversation_id, caller)


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(
    conversation_id: str,
    caller: CallerDep,
    serving: ResponsesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> ItemList:
    return await serving.conversations.list_items(conversation_id, caller, limit, order, after)


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, body: ItemsCreate, caller: CallerDep, serving: ResponsesDep) -> ItemList:
    return await serving.conversations.add_items(conversation_id, body.items, caller)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, caller: CallerDep, serving: ResponsesDep) -> dict[str, Any]:
    return await serving.conversations.item(conversation_id, item_id, caller)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, caller: CallerDep, serving: ResponsesDep) -> Conversation:
    return await serving.conversations.delete_item(conversation_id, item_id, caller)
