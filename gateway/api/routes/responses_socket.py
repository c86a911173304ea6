"""WebSocket mode on /v1/responses: authenticated as on HTTP (``Authorization: Bearer``), then one
``ResponsesSocket`` per connection. A reader task takes the client's messages as they come (so a close is seen while
a response streams, and stops it); they are answered in order, one at a time."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from gateway.api.auth import Authenticator, Caller
from gateway.api.dependencies import Services
from gateway.api.errors import APIError, ClientDisconnected, NotFound
from gateway.api.serving.responses_socket import ResponsesSocket
from gateway.api.serving.stop_signals import when_set

logger = logging.getLogger(__name__)

router = APIRouter()


@router.websocket("/v1/responses")
async def responses_socket(websocket: WebSocket) -> None:
    caller = await _caller(websocket)
    if caller is None:
        return
    await websocket.accept()
    services = websocket.app.state.services
    assert isinstance(services, Services)  # create_app builds them
    closed = asyncio.Event()
    inbox: asyncio.Queue[str | None] = asyncio.Queue()
    reader = asyncio.create_task(_read(websocket, inbox, closed))
    reason = when_set(closed, lambda: ClientDisconnected("the client closed the socket", "client_disconnected"))
    socket = ResponsesSocket(services.responses, caller, websocket.send_text, reason)
    try:
        while (text := await inbox.get()) is not None:
            await _answer(socket, text, closed)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        with contextlib.suppress(RuntimeError):  # already closed by the client
            await websocket.close()


async def _answer(socket: ResponsesSocket, text: str, closed: asyncio.Event) -> None:
    """One message answered; if the client leaves meanwhile, the response it was making is cancelled."""
    work = asyncio.create_task(socket.handle(text))
    gone = asyncio.create_task(closed.wait())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client left as the answer ended
            work.result()
        return
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    if socket.running is not None:
        with contextlib.suppress(NotFound):
            await socket.serving.chat.sessions.cancel(socket.running, socket.caller)


async def _read(websocket: WebSocket, inbox: asyncio.Queue[str | None], closed: asyncio.Event) -> None:
    try:
        while True:
            inbox.put_nowait(await websocket.receive_text())
    except (WebSocketDisconnect, RuntimeError, KeyError):  # closed (KeyError: a binary frame has no "text")
        pass
    finally:
        closed.set()
        inbox.put_nowait(None)


async def _caller(websocket: WebSocket) -> Caller | None:
    """The caller, or None once the handshake has been refused with the HTTP error an HTTP request would get."""
    authenticator = websocket.app.state.authenticator
    assert isinstance(authenticator, Authenticator)  # create_app sets it
    try:
        return await authenticator.caller(websocket.headers.get("authorization"))
    except APIError as exc:
        await websocket.send_denial_response(JSONResponse(exc.body(), status_code=exc.status))
        return None
