"""/v1/sessions: list, look at, cancel and resume generations — from any gateway replica.

A caller sees its own sessions (an admin key, or an open gateway, sees all); others' ids answer 404.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query
from fastapi.responses import Response
from pydantic import BaseModel

from gateway.api.auth import CallerDep
from gateway.api.dependencies import SessionsDep
from gateway.api.errors import InvalidRequest
from gateway.api.openapi_docs import errors, streamed
from gateway.api.protocol.chat import ChatCompletionChunk
from gateway.api.protocol.completions import CompletionResponse
from gateway.api.protocol.responses import ResponseStreamEvent
from gateway.api.sse import event_stream
from gateway.state.store import SessionRecord

router = APIRouter(responses=errors(401))


class SessionObject(SessionRecord):
    object: Literal["session"] = "session"


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionObject]


def _object(record: SessionRecord) -> SessionObject:
    return SessionObject(**record.model_dump())


@router.get("/v1/sessions", responses=errors(400))
async def list_sessions(
    caller: CallerDep, sessions: SessionsDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> SessionList:
    records = await sessions.store.list_sessions(None if caller.admin else caller.key_id)
    return SessionList(data=[_object(record) for record in records[:limit]])


@router.get("/v1/sessions/{session_id}", responses=errors(404))
async def get_session(session_id: str, caller: CallerDep, sessions: SessionsDep) -> SessionObject:
    return _object(await sessions.visible(session_id, caller))


@router.delete("/v1/sessions/{session_id}", responses=errors(404))
async def cancel_session(session_id: str, caller: CallerDep, sessions: SessionsDep) -> SessionObject:
    """Stops the generation wherever it runs and frees its node caches; the record as it ended."""
    return _object(await sessions.cancel(session_id, caller))


@router.get(
    "/v1/sessions/{session_id}/events",
    response_model=None,
    response_class=Response,  # documents no JSON body: the events are all it answers
    responses={**streamed(CompletionResponse, ChatCompletionChunk, ResponseStreamEvent), **errors(400, 404)},
)
async def session_events(
    session_id: str,
    caller: CallerDep,
    sessions: SessionsDep,
    last_event_id: Annotated[str | None, Header()] = None,
    after: Annotated[int | None, Query(ge=0, description="resume after this event id (instead of the header)")] = None,
) -> Response:
    """The session's SSE events after ``Last-Event-ID`` (all of them without it), then its live tail."""
    await sessions.visible(session_id, caller)
    start = after if after is not None else _event_number(last_event_id)
    return event_stream(sessions.read(session_id, start), session_id)


def _event_number(header: str | None) -> int:
    if header is None or not header.strip():
        return 0
    if not header.strip().isdigit():
        raise InvalidRequest("Last-Event-ID must be an event id of this session.", "invalid_value", "Last-Event-ID")
    return int(header.strip())
