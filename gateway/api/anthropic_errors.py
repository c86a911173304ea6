"""Anthropic's error body and status codes on the Messages API's paths, for every error they answer.

    ours (errors.py)                       Anthropic
    400 invalid_request_error              400 invalid_request_error   (validation too: never 422)
    401 invalid_api_key                    401 authentication_error
    404 model_not_found, not_found         404 not_found_error
    413 request too large                  413 request_too_large
    429 rate_limit_exceeded                429 rate_limit_error (Retry-After kept)
    503 missing_blocks, swarm_unavailable, 529 overloaded_error: the swarm cannot serve now, retry (the SDKs do)
        draining, shutting_down,
        auth_unavailable
    500 internal_error                     500 api_error
    other 4xx (405, 409 cancelled)         the same status, invalid_request_error (as Anthropic documents; a 409's
                                           x-should-retry: false kept, so the SDK does not send it again)

    body: {"type": "error", "error": {"type": ..., "message": ...}}

``errors.py`` stays the one place that decides what went wrong; this edge only rewrites the envelope, as a
middleware around the whole app for ``/v1/messages`` paths, so the errors answered before a route runs (401 from
auth, 413 from the body limit, 400 from validation, 404 for an unknown path beneath) get the same shape. In a stream,
the error event the session writes (OpenAI's body) becomes Anthropic's ``error`` event (``stream_error``).
"""

from __future__ import annotations

import json
from typing import Any

PATH = "/v1/messages"

_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_STATUS_OF_TYPE = {  # our envelope's ``type`` -> its HTTP status (a stream's error event has no status)
    "service_unavailable": 503,
    "server_error": 500,
    "requests": 429,
    "tokens": 429,
}
_STATUS_OF_CODE = {"invalid_api_key": 401, "model_not_found": 404, "not_found": 404, "session_not_found": 404}


def is_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def anthropic_status(status: int) -> int:
    return 529 if status == 503 else status


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = _BY_STATUS.get(anthropic_status(status), "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stream_error(body: dict[str, Any]) -> dict[str, Any]:
    """The ``error`` event for the body of our stream error event (``{"error": {message, type, code}}``)."""
    found = body.get("error")
    error: dict[str, Any] = found if isinstance(found, dict) else {}
    status = _STATUS_OF_CODE.get(str(error.get("code")), _STATUS_OF_TYPE.get(str(error.get("type")), 400))
    return anthropic_body(status, str(error.get("message") or "The stream failed."))


def _message(body: bytes, status: int) -> str:
    """Our message, led by the field it is about (Anthropic's body has no ``param``) unless it names it already."""
    try:
        error = json.loads(body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace") or f"HTTP {status}"
    return f"{param}: {message}" if param and f"'{param}'" not in message else message


def anthropic_error(status: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """Our error response (status, OpenAI's body) as Anthropic's (``ErrorShapeMiddleware``'s rewrite)."""
    return anthropic_status(status), anthropic_body(status, _message(body, status))
