"""Server-sent events as OpenAI streams them: ``data: {json}`` per chunk, then ``data: [DONE]``.

An error after the stream has started can no longer change the status: it becomes a final ``data: {"error": …}``
event (the ``openai`` client raises it as an APIError), still followed by ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse

from gateway.api.errors import as_api_error

DONE = "[DONE]"
PING_SECONDS = 15  # comment lines that keep idle proxies from closing a slow stream


async def with_done(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        yield json.dumps(as_api_error(exc).body())
    yield DONE


def event_stream(chunks: AsyncIterator[str], session_id: str) -> EventSourceResponse:
    return EventSourceResponse(chunks, headers={"X-Session-Id": session_id}, ping=PING_SECONDS, sep="\n")
