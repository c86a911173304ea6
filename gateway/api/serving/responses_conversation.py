"""A response made with ``conversation``: the conversation's items are its context (before its own input), and once
it has ended (completed or incomplete) its input items and output items are added to the conversation, in order."""

from __future__ import annotations

from typing import Any

from gateway.api.auth import Caller
from gateway.api.errors import InvalidRequest
from gateway.api.protocol.responses import InputItem, ResponseObject, ResponsesRequest
from gateway.api.serving.conversations import ConversationServing, stored_item
from gateway.api.serving.responses_translate import Message, input_messages

# Items a conversation keeps that are no context for the next turn: the chat path replays no reasoning either.
_NOT_CONTEXT = {"reasoning"}


def conversation_id(body: ResponsesRequest) -> str | None:
    """The conversation named (its id, or ``{"id": ...}``); 400 for anything else."""
    named: Any = body.conversation
    if named is None:
        return None
    if isinstance(named, dict):
        named = named.get("id")
    if not isinstance(named, str) or not named:
        raise InvalidRequest("conversation must be a conversation id or {'id': ...}.", "invalid_value", "conversation")
    if body.previous_response_id is not None:
        raise InvalidRequest(
            "conversation and previous_response_id cannot be used together.", "invalid_value", "conversation"
        )
    return named


async def context_of(conversations: ConversationServing, conversation: str, caller: Caller) -> list[Message]:
    items = await conversations.items(conversation, caller, "conversation")
    kept = [InputItem.model_validate(item) for item in items if item.get("type") not in _NOT_CONTEXT]
    return input_messages(kept) if kept else []


async def record_turn(
    conversations: ConversationServing, conversation: str, body: ResponsesRequest, response: ResponseObject
) -> None:
    """The response's input then its output, as the conversation's newest items."""
    given = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    made = [item.model_dump(mode="json") for item in response.output]
    await conversations.append(conversation, [stored_item(item) for item in given] + made)
