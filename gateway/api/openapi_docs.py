"""What the OpenAPI spec says a route answers: its errors in OpenAI's envelope, and its SSE streams event by event.

Routes declare these with FastAPI's ``responses=``, so the spec lists every status a route can send (checked by
schemathesis in tests/unit/gateway/api/test_api_schema_fuzz.py). FastAPI documents a 422 on every route with
parameters, but validation failures are answered 400 (``gateway.api.errors``): ``install_openapi`` takes that 422 out.

A stream's events follow OpenAPI 3.2's reading of ``text/event-stream``: ``schema`` describes one event, whose
``data`` is the literal ``[DONE]`` or a JSON chunk — or, once the stream has started, an error envelope.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.api.protocol.chat import ChatCompletionChunk
from gateway.api.protocol.common import ErrorResponse
from gateway.api.protocol.completions import CompletionResponse
from gateway.api.protocol.responses import ResponseStreamEvent

Responses = dict[int | str, dict[str, Any]]

_ERRORS = {
    400: "Bad JSON or parameters (invalid_json, invalid_value, invalid_type, context_length_exceeded, ...)",
    401: "A missing or wrong API key (invalid_api_key)",
    404: "No such model, session or response (model_not_found, session_not_found, response_not_found)",
    409: "The session was cancelled (session_cancelled)",
    413: "The request body is over the server's limit (payload_too_large)",
    429: "Over a rate limit or the cap on concurrent generations (rate_limit_exceeded, with Retry-After)",
    500: "An unexpected error (internal_error); nothing about its cause",
    503: "The swarm cannot serve now (missing_blocks, swarm_unavailable, draining)",
}
# The chunk models streams carry; FastAPI only puts models that routes name into the spec's components.
_STREAMED: tuple[type[BaseModel], ...] = (CompletionResponse, ChatCompletionChunk, ResponseStreamEvent, ErrorResponse)
_REF = "#/components/schemas/{model}"


def errors(*statuses: int) -> Responses:
    """``responses=`` entries for these statuses (500 always): each an ``ErrorResponse``."""
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in sorted({*statuses, 500})}


def streamed(*chunks: type[BaseModel], json_model: type[BaseModel] | None = None) -> Responses:
    """A 200 that is ``json_model`` as JSON (when given) or, with ``stream: true``, SSE events of ``chunks``."""
    models: list[type[BaseModel]] = [*chunks, ErrorResponse]
    payloads = [{"$ref": _REF.format(model=model.__name__)} for model in models]
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": payloads}},
        ]
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": data,
            "id": {"type": "string"},
            "event": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }
    response: dict[str, Any] = {"description": "The SSE stream", "content": {"text/event-stream": {"schema": event}}}
    if json_model is not None:
        response |= {"model": json_model, "description": "The answer, or its SSE stream with `stream: true`"}
    return {200: response}


def install_openapi(app: FastAPI) -> None:
    """Build the spec once, then take out FastAPI's 422s and add the streamed chunk models to its components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = build()
            for operations in spec.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            _, defs = models_json_schema([(m, "serialization") for m in _STREAMED], ref_template=_REF)
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
