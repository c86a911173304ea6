"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (errors in Anthropic's body, from
``gateway.api.anthropic_errors``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.api.dependencies import ContextDep, respond, services
from gateway.api.protocol.messages import (
    AnthropicError,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageStreamEvent,
    TokenCount,
)
from gateway.api.serving.messages import MessagesServing

_ERRORS = {
    400: "Bad JSON or parameters, or content this text model cannot take (invalid_request_error)",
    401: "A missing or wrong API key, in x-api-key or Authorization: Bearer (authentication_error)",
    404: "No such model (not_found_error)",
    413: "The request body is over the server's limit (request_too_large)",
    429: "Over a rate limit or the cap on concurrent generations (rate_limit_error, with Retry-After)",
    500: "An unexpected error (api_error); nothing about its cause",
    529: "The swarm cannot serve now: missing blocks, failed nodes, draining (overloaded_error)",
}


def _responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": AnthropicError, "description": _ERRORS[status]} for status in statuses}


def _stream() -> dict[int | str, dict[str, Any]]:
    """A message as JSON, or with ``stream: true`` Anthropic's SSE: ``event: <type>`` and its JSON ``data``."""
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": MessageStreamEvent.model_json_schema(),
    }
    event = {
        "type": "object",
        "required": ["data", "event"],
        "properties": {
            "data": data,
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }
    return {
        200: {
            "model": MessageResponse,
            "description": "The message, or its SSE stream with `stream: true`",
            "content": {"text/event-stream": {"schema": event}},
        }
    }


def _messages(request: Request) -> MessagesServing:
    return MessagesServing(services(request).chat)


MessagesDep = Annotated[MessagesServing, Depends(_messages)]

router = APIRouter(responses=_responses(400, 401, 404, 413, 429, 500, 529))


@router.post("/v1/messages", response_model=None, responses=_stream())
async def create_message(body: MessagesRequest, serving: MessagesDep, context: ContextDep) -> Response:
    """Anthropic's Messages API over the chat path (the same template, tools grammar and parsers)."""
    return respond(await serving.create(body, context))


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(body: CountTokensRequest, serving: MessagesDep) -> TokenCount:
    """The prompt's tokens as /v1/messages would render it (system, tools, conversation)."""
    return await serving.count_tokens(body)
