"""Server-sent events as OpenAI streams them: ``data: {json}`` per chunk, then ``data: [DONE]``.

Each event also carries an ``id`` (its number in the session's event log) so that a client can resume with
``Last-Event-ID``. An error after the stream has started can no longer change the status: it becomes a final
``data: {"error": …}`` event (the ``openai`` client raises it as an APIError), still followed by ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent

DONE = "[DONE]"
PING_SECONDS = 15  # comment lines that keep idle proxies from closing a slow stream


class _Ping(ServerSentEvent):
    """A keep-alive comment line without the blank line that would end an event. After an event with an ``id``,
    the openai client's decoder (which keeps the last id, as the spec says) turns ``: ping`` + blank line into an
    event with empty data and fails to parse it; the next event's own blank line ends this one instead."""

    def encode(self) -> bytes:
        return b": ping\n"


def event_stream(
    events: AsyncIterator[ServerSentEvent], session_id: str, ping_seconds: float = PING_SECONDS
) -> EventSourceResponse:
    return EventSourceResponse(
        events, headers={"X-Session-Id": session_id}, ping=ping_seconds, sep="\n", ping_message_factory=_Ping
    )
