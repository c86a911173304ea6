"""WebSocket mode of /v1/responses (Open Responses; OpenAI's "WebSocket mode"): one connection, many responses.

The client sends ``response.create`` messages (a Responses create body plus ``"type": "response.create"``); each is
answered by the same events a streamed HTTP response has, one JSON text message each, and the next message is read
only once the response has ended: responses on one socket run one at a time, in order. ``previous_response_id``
continues any response this socket made (``store: false`` ones too, which are kept only for the socket's life, in a
``Kept``) or one stored in Redis. A request that fails before it starts is one ``error`` message with the HTTP status it
would have had (``previous_response_not_found`` for an unknown previous response); the socket stays open.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from gateway.api.auth import Caller
from gateway.api.errors import APIError, InvalidRequest, as_api_error, validation_error
from gateway.api.protocol.responses import ResponsesRequest
from gateway.api.serving.common import RequestContext, Stream
from gateway.api.serving.responses import ResponsesServing
from gateway.api.serving.stop_signals import Signal
from gateway.api.sse import DONE
from gateway.state.responses_store import Kept

Send = Callable[[str], Awaitable[None]]


class ResponsesSocket:
    """One client's connection: what it has made so far, and how to answer its next message."""

    def __init__(self, serving: ResponsesServing, caller: Caller, send: Send, closed: Signal) -> None:
        self.serving = serving
        self.caller = caller
        self.send = send
        self.closed = closed  # fires when the client goes away (stops the response being made)
        self.kept = Kept()
        self.running: str | None = None  # the response being streamed now (cancelled if the socket closes)

    async def handle(self, text: str) -> None:
        """Answer one client message; every failure is an ``error`` message, never a closed socket."""
        try:
            body = self._request(text)
            result = await self.serving.create(body, RequestContext(self.caller, self.closed), self.kept)
        except Exception as exc:
            await self.send(json.dumps(error_event(as_api_error(exc))))
            return
        if not isinstance(result, Stream):  # create always streams here (stream is forced on)
            raise TypeError("a WebSocket response must be streamed")
        self.running = result.id
        await self._relay(result)
        self.running = None

    async def _relay(self, stream: Stream) -> None:
        async for event in stream.events:
            if isinstance(event, bytes):  # a keep-alive comment: the socket has its own pings
                continue
            data = str(event.data)
            if data == DONE:
                return
            parsed = json.loads(data)
            if "type" not in parsed:  # the session's own end (a cancel, a lost replica) in OpenAI's error body
                data = json.dumps({"type": "error", **parsed})
            await self.send(data)

    def _request(self, text: str) -> ResponsesRequest:
        try:
            message = json.loads(text)
        except ValueError:
            raise InvalidRequest("We could not parse the JSON of your message.", "invalid_json") from None
        if not isinstance(message, dict) or message.get("type") != "response.create":
            kind = message.get("type") if isinstance(message, dict) else None
            raise InvalidRequest(
                f"Unsupported message type {kind!r}: this socket takes 'response.create' messages.",
                "invalid_event",
                "type",
            )
        return parsed_body(message)


def parsed_body(message: dict[str, Any]) -> ResponsesRequest:
    """The create body of a ``response.create`` message: streamed by nature; ``background`` has no meaning here."""
    fields = {key: value for key, value in message.items() if key != "type"}
    if fields.get("background"):
        raise InvalidRequest("background is not supported in WebSocket mode.", "unsupported_parameter", "background")
    fields["stream"] = True
    try:
        return ResponsesRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None


def error_event(error: APIError) -> dict[str, Any]:
    """A request that could not start, as WebSocket mode reports it: the error body with its HTTP status."""
    return {"type": "error", "status": error.status, **error.body()}
