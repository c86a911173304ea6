"""Request bodies over a size limit get 413 before anything parses them.

A declared ``Content-Length`` over the limit is refused without reading a byte; a chunked body is read here up to
the limit (and refused once it passes it) before the app sees it. Starlette has no such limit of its own, and
FastAPI would read and JSON-parse a body of any size.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.errors import APIError


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than this server's limit of {limit} bytes.", "payload_too_large")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await PayloadTooLarge(self.max_bytes).response()(scope, receive, send)
            return
        if declared is not None:
            await self.app(scope, receive, send)  # the server stops reading at the declared length
            return
        # A chunked body: read it here (at most the limit), then hand it to the app in one piece.
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before finishing its request
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await PayloadTooLarge(self.max_bytes).response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
