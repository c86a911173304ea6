"""Streams that stall end with their whole text or an error, then [DONE] — never silently — and send keep-alives.

The same across real gateway processes and a frozen node is in tests/integration/test_gateway_sessions.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator

import httpx
import openai
import pytest

from gateway.api import request_log
from gateway.api.auth import Caller
from gateway.api.serving import live_sessions
from gateway.api.serving.common import ServingConfig
from gateway.api.serving.live_sessions import SessionTracker
from gateway.app import create_app
from gateway.state import store
from gateway.state.redis_link import RedisLink
from gateway.state.store import SessionStore
from tests.helpers.scripted_engine import ScriptedEngine, completion, sse_data

KEEPALIVE = 0.1


def make_client(engine: ScriptedEngine, keepalive: float = KEEPALIVE) -> httpx.AsyncClient:
    tracker = SessionTracker(SessionStore(RedisLink(None), "test"), None, engine.model_name, 0.0, keepalive=keepalive)
    app = create_app(engine, ServingConfig(engine.model_name), tracker)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def text_of(data: list[str]) -> str:
    return "".join(choice["text"] for chunk in data[:-1] for choice in json.loads(chunk)["choices"])


async def test_a_stall_longer_than_the_stale_window_gives_the_whole_text_then_done_with_keepalives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every timeout of the HTTP path far shorter than the stall: a record's age no longer means a dead replica.
    monkeypatch.setattr(store, "STALE_AFTER", 0.2)
    engine = ScriptedEngine(script="hello world", stall_at=3, stall_seconds=1.0)
    async with make_client(engine) as client:
        response = await client.post("/v1/completions", json=completion(stream=True))
    data = sse_data(response)
    assert data[-1] == "[DONE]" and text_of(data) == "hello world"
    keepalives = [line for line in response.text.splitlines() if line == ": keep-alive"]
    assert len(keepalives) >= 3, response.text  # ~1 s of silence at one comment per 0.1 s


@pytest.mark.parametrize("stream", [True, False])
async def test_a_response_has_one_created_in_every_chunk_and_the_usage_chunk(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    clock = itertools.count(1_800_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))  # a second passes at every look at the clock
    body = completion(stream=stream, stream_options={"include_usage": True} if stream else None)
    async with make_client(ScriptedEngine(script="hello world")) as client:
        response = await client.post("/v1/completions", json=body)
    bodies = [json.loads(data) for data in sse_data(response)[:-1]] if stream else [response.json()]
    created = {body["created"] for body in bodies}
    assert len(created) == 1 and created.pop() >= 1_800_000_000, bodies


async def test_a_busy_stream_sends_no_keepalives() -> None:
    """A token every 0.05 s for over a second: busy throughout, though it outlasts the keep-alive period twice (a
    loaded machine can delay a token by more than the others' 0.1 s period, so this one is longer)."""
    engine = ScriptedEngine(script="hello world hello world", token_seconds=0.05)
    async with make_client(engine, keepalive=0.5) as client:
        response = await client.post("/v1/completions", json=completion(stream=True, max_tokens=32))
    assert ": keep-alive" not in response.text and sse_data(response)[-1] == "[DONE]"
    assert text_of(sse_data(response)) == "hello world hello world"


async def test_the_openai_client_ignores_keepalives() -> None:
    engine = ScriptedEngine(script="hello world", stall_at=5, stall_seconds=0.5)
    tracker = SessionTracker(SessionStore(RedisLink(None), "test"), None, engine.model_name, 0.0, keepalive=KEEPALIVE)
    app = create_app(engine, ServingConfig(engine.model_name), tracker)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", max_retries=0, http_client=http)
    async with http:
        stream = await client.completions.create(model="scripted", prompt="ab", max_tokens=20, stream=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello world"
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_a_stalled_generation_that_fails_ends_with_an_error_event_then_done() -> None:
    from shared.errors import NodeUnreachable

    engine = ScriptedEngine(stall_at=2, stall_seconds=0.5, failure=NodeUnreachable("lost node"), fail_at=4)
    async with make_client(engine) as client:
        response = await client.post("/v1/completions", json=completion(stream=True))
    data = sse_data(response)
    assert data[-1] == "[DONE]" and "error" in json.loads(data[-2])
    assert ": keep-alive" in response.text.splitlines()


async def test_ignore_eos_keeps_generating_through_an_end_token_at_the_first_position() -> None:
    engine = ScriptedEngine(script="<<ab<c")  # "<" is the EOS token
    async with make_client(engine) as client:
        ignored = (await client.post("/v1/completions", json=completion(max_tokens=6, ignore_eos=True))).json()
        honoured = (await client.post("/v1/completions", json=completion(max_tokens=6))).json()
        streamed = await client.post("/v1/completions", json=completion(max_tokens=6, ignore_eos=True, stream=True))
    assert (ignored["choices"][0]["text"], ignored["choices"][0]["finish_reason"]) == ("abc", "length")
    assert ignored["usage"]["completion_tokens"] == 6
    assert (honoured["choices"][0]["text"], honoured["choices"][0]["finish_reason"]) == ("", "stop")
    assert honoured["usage"]["completion_tokens"] == 1
    assert text_of(sse_data(streamed)[:-1]) == "abc"


async def test_ignore_eos_still_honours_stop_strings() -> None:
    async with make_client(ScriptedEngine(script="<ab<cd")) as client:
        body = completion(max_tokens=6, ignore_eos=True, stop=["c"])
        choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("ab", "stop")


async def test_a_stream_whose_response_starts_reading_late_is_not_stopped_as_abandoned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gateway process starved for longer than ``resume_grace`` between handing the stream to its response and the
    response's first read (CI saw it) must not stop the stream as abandoned: its client is there, not gone."""
    monkeypatch.setattr(live_sessions, "WATCH_PERIOD", 0.01)
    tracker = SessionTracker(SessionStore(RedisLink(None), "test"), None, "scripted", 0.05, keepalive=KEEPALIVE)
    live = await tracker.open(request_log.RequestRecord("cmpl-late", "completions", 1, 3), Caller("k", False), 8)

    async def chunks() -> AsyncGenerator[str, None]:
        for piece in ("hello", "world"):
            yield json.dumps({"text": piece})
            await asyncio.sleep(0.05)

    reader = live.stream(chunks())
    await asyncio.sleep(0.3)  # thirty checks for readers, six times resume_grace: nobody has read yet
    events = [event async for event in reader if not isinstance(event, bytes)]
    assert [event.data for event in events] == [json.dumps({"text": "hello"}), json.dumps({"text": "world"}), "[DONE]"]
    await tracker.close()


async def test_a_stream_read_only_on_another_replica_is_stopped_soon_after_that_reader_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that resumed on another replica and then left: ``resume_grace`` applies, not the first reader's 30 s
    (the stream would go on generating for nobody)."""
    monkeypatch.setattr(live_sessions, "WATCH_PERIOD", 0.01)
    tracker = SessionTracker(SessionStore(RedisLink(None), "test"), None, "scripted", 0.05, keepalive=KEEPALIVE)
    live = await tracker.open(request_log.RequestRecord("cmpl-remote", "completions", 1, 3), Caller("k", False), 8)
    remote_reads = asyncio.Event()
    remote_left = asyncio.Event()

    async def remote_reader(_session_id: str) -> bool:
        remote_reads.set()
        return not remote_left.is_set()

    monkeypatch.setattr(tracker, "remote_reader", remote_reader)

    async def chunks() -> AsyncGenerator[str, None]:
        while True:  # generates until stopped
            yield json.dumps({"text": "x"})
            await asyncio.sleep(0.01)

    live.stream(chunks())
    async with asyncio.timeout(5):
        await remote_reads.wait()
    remote_left.set()
    async with asyncio.timeout(2):  # resume_grace (0.05 s) and its checks, far below FIRST_READER_GRACE (30 s)
        await live._stop.wait()
    async with asyncio.timeout(5):  # the events as a client resuming now reads them
        events = [event.data async for event in tracker.read(live.id, 0) if not isinstance(event, bytes)]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "session_cancelled"
    assert "no client read its stream for" in error["message"] and "DELETE" not in error["message"]
    await tracker.close()


async def test_a_stream_stopped_by_the_gateways_shutdown_says_so() -> None:
    tracker = SessionTracker(SessionStore(RedisLink(None), "test"), None, "scripted", 5.0, keepalive=KEEPALIVE)
    live = await tracker.open(request_log.RequestRecord("cmpl-closing", "completions", 1, 3), Caller("k", False), 8)
    produced = asyncio.Event()

    async def chunks() -> AsyncGenerator[str, None]:
        while True:  # generates until stopped
            yield json.dumps({"text": "x"})
            produced.set()
            await asyncio.sleep(0.01)

    reader = live.stream(chunks())
    async with asyncio.timeout(5):
        await produced.wait()
        await tracker.close()
        events = [event.data async for event in reader if not isinstance(event, bytes)]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == ("shutting_down", "service_unavailable"), error
    assert "the gateway is shutting down" in error["message"], error
