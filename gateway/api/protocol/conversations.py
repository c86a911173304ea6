"""OpenAI's Conversations API: a conversation (id, metadata) and its items (Responses items: messages, function calls
and their outputs), listed in pages. A response made with ``conversation`` reads its items as context and adds its
input and output to them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.api.protocol.common import RequestModel, ResponseModel
from gateway.api.protocol.responses import InputItem


class ConversationCreate(RequestModel):
    items: list[InputItem] | None = Field(None, max_length=20)  # as OpenAI: at most 20 at creation
    metadata: dict[str, str] | None = None


class ConversationUpdate(RequestModel):
    metadata: dict[str, str]


class ItemsCreate(RequestModel):
    items: list[InputItem] = Field(min_length=1, max_length=20)


class Conversation(ResponseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str]


class DeletedConversation(ResponseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True


class ItemList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
