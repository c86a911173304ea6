"""Sessions, keys and limits at the HTTP edge over a scripted engine, with the store in memory (no Redis).

The same features across two real replicas sharing a real Redis are in tests/integration/test_gateway_sessions.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import httpx

from gateway.api.auth import Authenticator
from gateway.api.serving.common import ServingConfig
from gateway.api.serving.live_sessions import SessionTracker
from gateway.app import create_app
from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest
from gateway.state.redis_link import RedisLink
from gateway.state.store import SessionStore
from tests.helpers.polling import eventually
from tests.helpers.scripted_engine import ALPHABET, ScriptedEngine, completion, sse_data


@dataclass
class SlowEngine(ScriptedEngine):
    """One token every 20 ms: long enough to act on a generation while it runs; ``started`` once one runs."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    cleanup: asyncio.Event | None = None  # set: a stopped generation's cleanup waits for it (slow node closes)
    streaming: asyncio.Event = field(default_factory=asyncio.Event)  # set once two tokens went out

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        self.active += 1
        self.started.set()
        produced = 0
        try:
            for char in self.script[: request.max_new_tokens]:
                await asyncio.sleep(0.02)
                produced += 1
                if produced == 2:
                    self.streaming.set()
                yield GeneratedToken(ALPHABET.index(char), False, -0.1)
        finally:
            if self.cleanup is not None:
                await self.cleanup.wait()
            self.active -= 1
            if produced < min(len(self.script), request.max_new_tokens):
                self.closed_early += 1


def make_client(
    engine: ScriptedEngine, keys: list[str] | None = None, max_running: int = 0, max_bytes: int = 1 << 20
) -> httpx.AsyncClient:
    tracker = SessionTracker(SessionStore(RedisLink(None), "test"), None, engine.model_name, 0.0, max_running)
    authenticator = Authenticator(keys or [], None, enabled=bool(keys))
    app = create_app(engine, ServingConfig(engine.model_name, max_request_bytes=max_bytes), tracker, authenticator)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def sse_ids(response: httpx.Response) -> list[str]:
    return [line.removeprefix("id: ") for line in response.text.splitlines() if line.startswith("id: ")]


async def test_stream_events_are_numbered_and_a_session_replays_after_any_event_id() -> None:
    async with make_client(ScriptedEngine(script="abcdef")) as client:
        response = await client.post("/v1/completions", json=completion(stream=True, max_tokens=6))
        session_id = response.headers["x-session-id"]
        data = sse_data(response)
        assert sse_ids(response) == [str(n) for n in range(1, len(data) + 1)] and data[-1] == "[DONE]"
        resumed = await client.get(f"/v1/sessions/{session_id}/events", headers={"Last-Event-ID": "2"})
        assert sse_data(resumed) == data[2:] and sse_ids(resumed)[0] == "3"
        assert sse_data(await client.get(f"/v1/sessions/{session_id}/events?after=0")) == data
        record = (await client.get(f"/v1/sessions/{session_id}")).json()
        assert (record["object"], record["status"], record["completion_tokens"]) == ("session", "finished", 6)
        assert record["finish_reason"] == "length" and record["prompt_tokens"] == 2
        listed = (await client.get("/v1/sessions")).json()
        assert [s["id"] for s in listed["data"]] == [session_id]
        plain = await client.post("/v1/completions", json=completion(max_tokens=3))
        assert (await client.get(f"/v1/sessions/{plain.json()['id']}")).json()["status"] == "finished"
        missing = await client.get("/v1/sessions/cmpl-nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
        bad = await client.get(f"/v1/sessions/{session_id}/events", headers={"Last-Event-ID": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


async def test_delete_cancels_a_running_stream_which_ends_with_an_error_event_then_done() -> None:
    engine = SlowEngine(script="abcdefghijklmnopqrstuvwxyz" * 2, context_length=128)
    async with make_client(engine) as client:
        request = asyncio.create_task(client.post("/v1/completions", json=completion(stream=True, max_tokens=50)))
        await engine.started.wait()
        listed = (await client.get("/v1/sessions")).json()["data"]
        await asyncio.sleep(0.1)
        cancelled = await client.delete(f"/v1/sessions/{listed[0]['id']}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        data = sse_data(await request)
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "session_cancelled"
        assert len(data) < 50 and engine.closed_early == 1 and engine.active == 0


async def test_a_cancelled_non_streamed_request_answers_409_that_clients_must_not_send_again() -> None:
    """The official OpenAI and Anthropic clients send a request again after a 409 unless told not to: the cancelled
    generation would run again (seen from outside with openai 3.63: two POSTs, the second ran to its end)."""
    engine = SlowEngine(script="abcdefghijklmnopqrstuvwxyz" * 2, context_length=128)
    async with make_client(engine) as client:
        request = asyncio.create_task(client.post("/v1/completions", json=completion(max_tokens=50)))
        await engine.streaming.wait()
        session_id = (await client.get("/v1/sessions")).json()["data"][0]["id"]
        assert (await client.delete(f"/v1/sessions/{session_id}")).status_code == 200
        answer = await asyncio.wait_for(request, 5)
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "session_cancelled"
    assert answer.headers["x-should-retry"] == "false"


async def test_a_non_streamed_request_cut_by_the_gateways_shutdown_answers_503_for_clients_to_retry() -> None:
    engine = SlowEngine(script="abcdefghijklmnopqrstuvwxyz" * 2, context_length=128)
    tracker = SessionTracker(SessionStore(RedisLink(None), "test"), None, engine.model_name, 0.0, 0)
    app = create_app(engine, ServingConfig(engine.model_name), tracker, Authenticator([], None, enabled=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        request = asyncio.create_task(client.post("/v1/completions", json=completion(max_tokens=50)))
        await engine.streaming.wait()
        await tracker.stop_all("the gateway is shutting down (its drain time of 1s ran out)")
        answer = await asyncio.wait_for(request, 5)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["type"]) == ("shutting_down", "service_unavailable")
    assert "drain time" in error["message"] and "x-should-retry" not in answer.headers


async def test_a_cancel_ends_the_stream_and_the_record_without_waiting_for_the_generations_cleanup() -> None:
    # Closing node sessions can be slow (a loaded box, a node that answers late): the user's stream and the replica
    # that relayed the DELETE must not wait for it. The cleanup still runs to its end.
    engine = SlowEngine(script="abcdefghijklmnopqrstuvwxyz" * 2, context_length=128, cleanup=asyncio.Event())
    async with make_client(engine) as client:
        request = asyncio.create_task(client.post("/v1/completions", json=completion(stream=True, max_tokens=50)))
        await engine.streaming.wait()  # past the first token: the response streams
        session_id = (await client.get("/v1/sessions")).json()["data"][0]["id"]
        cancelled = await client.delete(f"/v1/sessions/{session_id}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        data = sse_data(await asyncio.wait_for(request, 5))
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "session_cancelled"
        assert engine.active == 1  # its cleanup still runs
        engine.cleanup.set()
        await eventually(lambda: engine.active == 0, within=5)
        assert engine.closed_early == 1


async def test_operator_keys_turn_authentication_on_for_every_v1_route_but_not_probes() -> None:
    async with make_client(ScriptedEngine(), keys=["sk-operator-key"]) as client:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-operator-key"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/v1/sessions"), ("POST", "/v1/completions")):
                response = await client.request(method, path, headers=headers, json=completion())
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"] == {
                    "message": response.json()["error"]["message"],
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).status_code == 200
        ok = await client.post(
            "/v1/completions", json=completion(), headers={"Authorization": "Bearer sk-operator-key"}
        )
        assert ok.status_code == 200


async def test_a_cap_on_concurrent_generations_answers_429_with_retry_after() -> None:
    engine = SlowEngine(script="abcdefghij")
    async with make_client(engine, max_running=1) as client:
        first = asyncio.create_task(client.post("/v1/completions", json=completion(max_tokens=10)))
        await engine.started.wait()
        refused = await client.post("/v1/completions", json=completion(max_tokens=2))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert (await first).status_code == 200
        assert (await client.post("/v1/completions", json=completion(max_tokens=2))).status_code == 200


async def test_bodies_over_the_limit_get_413_before_parsing_declared_or_chunked() -> None:
    engine = ScriptedEngine()
    async with make_client(engine, max_bytes=1000) as client:
        body = json.dumps(completion(prompt="a" * 2000)).encode()
        declared = await client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert declared.status_code == 413 and declared.json()["error"]["code"] == "payload_too_large"

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 256):
                yield body[start : start + 256]

        chunked = await client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
        assert (await client.post("/v1/completions", json=completion())).status_code == 200
