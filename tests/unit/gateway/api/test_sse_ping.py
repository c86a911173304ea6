"""Keep-alive pings between events with ids: the openai client must see only the events themselves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from openai._streaming import SSEDecoder
from sse_starlette import ServerSentEvent

from gateway.api.sse import event_stream


async def slow_events() -> AsyncIterator[ServerSentEvent]:
    for number in (1, 2):
        yield ServerSentEvent(data=f'{{"n": {number}}}', id=str(number))
        await asyncio.sleep(0.3)  # several pings' worth of silence
    yield ServerSentEvent(data="[DONE]", id="3")


async def test_pings_after_an_event_with_an_id_are_no_empty_events_for_the_openai_client() -> None:
    app = FastAPI()
    app.get("/stream")(lambda: event_stream(slow_events(), "s1", ping_seconds=0.05))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        body = (await client.get("/stream")).content
    assert b": ping" in body  # the pings were sent
    decoded = list(SSEDecoder().iter_bytes(iter([body])))
    assert [event.data for event in decoded] == ['{"n": 1}', '{"n": 2}', "[DONE]"]
    assert [event.id for event in decoded] == ["1", "2", "3"]
