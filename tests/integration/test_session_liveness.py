"""Session liveness across replicas against a real redis-server: the heartbeat, the end of a lost replica's stream,
and a local stream's chunks reaching their reader without a Redis round trip each.

Each replica is the real app (``create_app``, its tracker and store) over the scripted engine; the same across real
gateway processes and a frozen node is in tests/integration/test_gateway_sessions.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.api.serving import live_sessions
from gateway.api.serving.common import ServingConfig
from gateway.api.serving.live_sessions import SessionTracker
from gateway.app import create_app
from gateway.state import store
from gateway.state.redis_link import RedisLink
from gateway.state.store import SessionStore
from tests.helpers.redis_server import RedisServer
from tests.helpers.scripted_engine import ScriptedEngine, completion, sse_data

pytestmark = pytest.mark.timeout(120)

LONG = "the quick brown fox jumps over the lazy dog"


class Replica:
    def __init__(self, url: str, name: str, engine: ScriptedEngine) -> None:
        self.link = RedisLink(url)
        self.tracker = SessionTracker(SessionStore(self.link, name), None, engine.model_name, 0.0, keepalive=0.2)
        app = create_app(engine, ServingConfig(engine.model_name), self.tracker)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")

    async def close(self) -> None:
        await self.client.aclose()
        await self.tracker.close()
        await self.link.close()


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[tuple[Replica, Replica]]:
    a = Replica(redis_server.url, "A", ScriptedEngine(script="hello world", stall_at=3, stall_seconds=3.0))
    b = Replica(redis_server.url, "B", ScriptedEngine(script=LONG))
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def running_session(tracker: SessionTracker) -> str:
    deadline = time.monotonic() + 30
    while not tracker.live:
        assert time.monotonic() < deadline, "the session never started"
        await asyncio.sleep(0.01)
    return next(iter(tracker.live))


def text_of(data: list[str]) -> str:
    return "".join(c["text"] for chunk in data if chunk != "[DONE]" for c in json.loads(chunk).get("choices", []))


async def test_a_reader_on_another_replica_follows_a_stall_past_the_stale_window_thanks_to_the_heartbeat(
    replicas: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "STALE_AFTER", 1.0)  # the 3 s stall is three stale windows
    monkeypatch.setattr(live_sessions, "HEARTBEAT_SECONDS", 0.2)
    a, b = replicas
    streamed = asyncio.create_task(a.client.post("/v1/completions", json=completion(stream=True)))
    session_id = await running_session(a.tracker)
    followed = await b.client.get(f"/v1/sessions/{session_id}/events")
    data, own = sse_data(followed), sse_data(await streamed)
    assert data == own and data[-1] == "[DONE]" and text_of(data) == "hello world", followed.text
    assert ": keep-alive" in followed.text.splitlines()


async def test_a_reader_on_another_replica_ends_with_session_lost_then_done_when_the_replica_is_gone(
    replicas: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "STALE_AFTER", 1.0)
    a, b = replicas
    owner = SessionStore(a.link, "gone")  # a replica that wrote a record and two events, then died
    await owner.save(owner.new_record("cmpl-gone", "scripted", None, 2))
    await owner.append_event("cmpl-gone", '{"choices": [{"text": "he"}]}')
    await owner.append_event("cmpl-gone", '{"choices": [{"text": "llo"}]}')
    await owner._flush_events("cmpl-gone")
    followed = await b.client.get("/v1/sessions/cmpl-gone/events")
    data = sse_data(followed)
    assert text_of(data[:2]) == "hello" and data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "session_lost"


async def test_a_local_stream_reads_its_chunks_from_memory_not_through_redis(
    replicas: tuple[Replica, Replica],
) -> None:
    _, b = replicas  # B's engine does not stall
    await b.link.client.config_resetstat()
    response = await b.client.post("/v1/completions", json=completion(stream=True, max_tokens=len(LONG)))
    stats = await b.link.client.info("commandstats")
    assert sse_data(response)[-1] == "[DONE]"
    chunks = len(sse_data(response))
    reads = sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("get", "xrange", "xread"))
    # Before, the reader made a GET (and the producer waited for an XADD) per chunk; now only the end reads Redis.
    assert chunks > 20 and reads <= 3, stats
