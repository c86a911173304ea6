"""The HTTP edge's errors: the one module that decides statuses, in OpenAI's envelope.

    APIError                    status  type                    code (string, stable)
    ├── InvalidRequest          400     invalid_request_error   invalid_value, invalid_type, missing_required_parameter,
    │                                                           invalid_json, context_length_exceeded, ...
    ├── Unauthorized            401     invalid_request_error   invalid_api_key
    ├── NotFound                404     invalid_request_error   model_not_found, not_found, session_not_found
    ├── MethodNotAllowed        405     invalid_request_error   method_not_allowed
    ├── SessionEnded                                            (a generation stopped while it ran)
    │   ├── SessionCancelled    409     invalid_request_error   session_cancelled (a DELETE, an abandoned stream;
    │   │                                                       x-should-retry: false)
    │   └── SessionStopped      503     service_unavailable     shutting_down (the gateway's drain time ran out)
    ├── RateLimited             429     requests | tokens       rate_limit_exceeded (with Retry-After)
    ├── ServiceUnavailable      503     service_unavailable     missing_blocks, swarm_unavailable, draining,
    │                                                           session_lost (an SSE error event: its replica is gone),
    │                                                           auth_unavailable (Redis cannot check a key)
    ├── InternalError           500     server_error            internal_error
    └── ClientDisconnected      499     client_closed_request   client_disconnected (logged, never received)

Anything else raised while serving is logged once with its traceback and answered as ``InternalError``, whose
message says nothing about the cause. Request validation (FastAPI's 422) is answered 400, as OpenAI does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.protocol.common import ErrorInfo, ErrorResponse, UnsupportedParameter
from gateway.generation import InvalidPrompt
from shared.errors import MissingBlocks, ModelLoadError, SwarmError

logger = logging.getLogger(__name__)


class APIError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"


class SessionEnded(APIError):
    """A generation stopped on purpose while it ran: by its client (``SessionCancelled``) or by the gateway
    (``SessionStopped``). Whoever waits on it catches this; each kind says its own status."""


class SessionCancelled(SessionEnded):
    """A generation stopped on purpose: its session deleted, or its stream left unread. The official OpenAI and
    Anthropic clients send a request again after a 409 unless the answer says not to: that would run the
    cancelled generation again."""

    status = 409
    type = "invalid_request_error"

    def __init__(self, session_id: str, why: str | None = None) -> None:
        why = why or f"DELETE /v1/sessions/{session_id}"
        super().__init__(f"Session {session_id} was cancelled ({why}).", "session_cancelled")
        self.headers = {"x-should-retry": "false"}


class SessionStopped(SessionEnded):
    """A generation the gateway stopped as it shut down: nothing the client did, and another replica (or this one
    restarted) can serve it, so a 503 that clients retry."""

    status = 503
    type = "service_unavailable"

    def __init__(self, session_id: str, why: str | None = None) -> None:
        why = why or "the gateway is shutting down"
        super().__init__(f"Session {session_id} was stopped: {why}.", "shutting_down")


class RateLimited(APIError):
    """OpenAI's 429: ``type`` names what ran out (requests or tokens); ``Retry-After`` says when to come back."""

    status = 429

    def __init__(self, message: str, kind: str, retry_after: int) -> None:
        super().__init__(message, "rate_limit_exceeded")
        self.kind = kind
        self.headers = {"Retry-After": str(retry_after)}

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["type"] = self.kind
        return body


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable"


class ClientDisconnected(APIError):
    """The client left before the answer was ready (nginx's 499); nobody receives this response."""

    status = 499
    type = "client_closed_request"


class InternalError(APIError):
    status = 500
    type = "server_error"

    def __init__(self) -> None:
        super().__init__("The server had an error while processing your request.", "internal_error")


def model_not_found(model: str) -> NotFound:
    shown = model if len(model) <= 200 else model[:200] + "…"  # a 10 MB name is not echoed back whole
    return NotFound(f"The model `{shown}` does not exist.", "model_not_found", "model")


def as_api_error(exc: BaseException) -> APIError:
    """The client-facing error for anything raised while serving; unexpected ones are logged here, once."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnsupportedParameter):
        return InvalidRequest(str(exc), "unsupported_parameter", exc.param)
    if isinstance(exc, InvalidPrompt):
        return InvalidRequest(str(exc), "invalid_value", getattr(exc, "param", "messages"))
    if isinstance(exc, MissingBlocks):
        return ServiceUnavailable(f"The swarm cannot serve this model now: {exc}", "missing_blocks")
    if isinstance(exc, SwarmError) and not isinstance(exc, ModelLoadError):
        # Typed swarm failures (lost nodes, full caches, refusals) are the swarm's state, not a gateway bug. Their
        # text names peers and libp2p's errors: that goes to the log, the client gets the kind of failure.
        logger.warning("swarm failure answered 503: %s", exc)
        return ServiceUnavailable(f"The swarm failed to serve the request ({exc.code}), try again", "swarm_unavailable")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return InternalError()


# pydantic error types -> OpenAI-style string codes
_VALIDATION_CODES = {"missing": "missing_required_parameter", "json_invalid": "invalid_json"}


def first_complaint(exc: ValidationError, fallback: str) -> tuple[str, str]:
    """Pydantic's first complaint about a request built from another API's (Responses, Messages): the message and
    the top-level field it is about (``fallback`` when it names none)."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    top = str(first["loc"][0]) if first["loc"] else fallback
    return f"Invalid request: {first['msg']} (at {where}).", top


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    errors = exc.errors() or [{"type": "invalid", "loc": (), "msg": "invalid request"}]
    # A union reports every member's mismatch (``prompt: []`` is no string, ...): the error about the value wins.
    first = next((e for e in errors if not _is_type_error(str(e.get("type", "")))), errors[0])
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return InvalidRequest("We could not parse the JSON body of your request.", "invalid_json")
    param = _param_name(first.get("loc", ()))
    code = _VALIDATION_CODES.get(kind, "invalid_type" if _is_type_error(kind) else "invalid_value")
    if param is None:  # the body itself: none at all, or JSON that is no object (a list, 42, null)
        return InvalidRequest(f"The request body must be a JSON object ({first.get('msg', 'invalid')}).", code)
    message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}"
    return InvalidRequest(message, code, param)


def _is_type_error(kind: str) -> bool:
    return kind.endswith(("_type", "_parsing"))


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_name(loc: Any) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; union member tags like 'list[int]' are dropped."""
    name = ""
    for part in loc:
        if part == "body" and not name:
            continue
        if isinstance(part, int):
            name += f"[{part}]"
        elif "[" not in str(part) and str(part) not in _UNION_TAGS:
            name += f".{part}" if name else str(part)
    return name or None


def http_error(exc: HTTPException) -> APIError:
    if exc.status_code == 404:
        return NotFound("Not found.", "not_found")
    if exc.status_code == 405:
        return MethodNotAllowed("Method not allowed.", "method_not_allowed")
    if exc.status_code < 500:
        return InvalidRequest(str(exc.detail), "invalid_request")
    return InternalError()


def _allowed_methods(request: Request) -> list[str]:
    """Every method a route takes at this path: Starlette's 405 names only the first route's (GET, not DELETE)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, BaseRoute) and route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        error = validation_error(exc) if isinstance(exc, RequestValidationError) else as_api_error(exc)
        return error.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, HTTPException):
            return as_api_error(exc).response()
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return http_error(exc).response(headers)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Answers 500 in OpenAI's envelope for any exception that escapes a route, logging it once.

    Starlette's own ``Exception`` handler re-raises after responding, so the server would log the error a second
    time; this sits inside it and swallows the exception once it is answered.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            error = as_api_error(exc)
            if started:
                return  # too late for a status; the client sees the connection end
            response = error.response()
            await response(scope, receive, send)
