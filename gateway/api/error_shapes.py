"""Other APIs' error bodies for every error on their paths, the ones answered before a route runs included.

``errors.py`` stays the one place that decides what went wrong and answers in OpenAI's envelope; an API with an
envelope of its own (Anthropic's on ``/v1/messages``, Ollama's on ``/api/``) gets its errors rewritten here, as a
middleware around the whole app, so 401 from auth, 413 from the body limit and 400 from validation take its shape too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.anthropic_errors import anthropic_error, is_messages_path

# (status, our error body) -> (the status to answer, the body to answer)
Rewrite = Callable[[int, bytes], tuple[int, dict[str, Any]]]


@dataclass(frozen=True)
class ErrorShape:
    applies: Callable[[str], bool]  # to a request path
    rewrite: Rewrite


def ollama_error(status: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """Ollama's ``{"error": "..."}``: our message, or the body as it is when a route answered in that shape."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return status, {"error": body.decode("utf-8", "replace") or f"HTTP {status}"}
    return status, {"error": error if isinstance(error, str) else str(error.get("message", f"HTTP {status}"))}


SHAPES = (
    ErrorShape(is_messages_path, anthropic_error),
    ErrorShape(lambda path: path.startswith("/api/"), ollama_error),
)


class ErrorShapeMiddleware:
    """Rewrites every error response (status >= 400) on the paths of ``shapes`` into that API's body and status."""

    def __init__(self, app: ASGIApp, shapes: Sequence[ErrorShape] = SHAPES) -> None:
        self.app = app
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        shape = next((s for s in self.shapes if scope["type"] == "http" and s.applies(scope["path"])), None)
        if shape is None:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewriting_send(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is complete
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                await _send_rewritten(start, *shape.rewrite(start["status"], body), send)

        await self.app(scope, receive, rewriting_send)


async def _send_rewritten(start: Message, status: int, body: dict[str, Any], send: Send) -> None:
    payload = json.dumps(body).encode()
    kept = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
    headers = [*kept, (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
