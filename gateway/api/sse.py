"""Server-sent events as OpenAI streams them: ``data: {json}`` per chunk, then ``data: [DONE]``.

Each event also carries an ``id`` (its number in the session's event log) so that a client can resume with
``Last-Event-ID``. An error after the stream has started can no longer change the status: it becomes a final
``data: {"error": …}`` event (the ``openai`` client raises it as an APIError), still followed by ``[DONE]``.
While a stream has nothing to send, its reader (``SessionTracker.read``) sends ``: keep-alive`` comment lines, which
clients ignore and proxies count as traffic.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent

DONE = "[DONE]"
# Every line of every stream ends with LF. sse-starlette ends them with CRLF by default, and the ``sep`` given to
# ``EventSourceResponse`` applies only to what it wraps itself, not to a ``ServerSentEvent`` built elsewhere (as
# every event of ours is): readers that split lines on LF alone then see no events. So each event is built here.
SEPARATOR = "\n"
# sse-starlette's own pings (every 15 s by default, busy or not) are off: the reader sends keep-alives when idle.
NO_PINGS = 24 * 3600


def sse_event(data: str, id: str | None = None, retry: int | None = None) -> ServerSentEvent:
    """One event; a typed one (the Responses stream's, ``{"type": ...}`` first) is named for its type, as the Open
    Responses spec requires. Named here, where a resumed stream is read too, so a replay is the same bytes."""
    event = json.loads(data).get("type") if data.startswith('{"type":') else None
    return ServerSentEvent(data=data, id=id, retry=retry, event=event, sep=SEPARATOR)


def event_stream(events: AsyncIterator[ServerSentEvent | bytes], session_id: str) -> EventSourceResponse:
    return EventSourceResponse(events, headers={"X-Session-Id": session_id}, ping=NO_PINGS, sep=SEPARATOR)
