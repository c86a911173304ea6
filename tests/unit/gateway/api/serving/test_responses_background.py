"""background: true over a scripted engine: the response runs without the request that made it, is read while it
runs and when done, its stream is resumed from a sequence number, and it is cancelled. Across replicas (Redis):
tests/integration/test_responses_smollm2.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from gateway.api.serving import live_sessions
from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from tests.helpers.ascii_engine import AsciiEngine
from tests.helpers.polling import eventually


def client_for(engine: AsciiEngine) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig(engine.model_name))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def events(reply: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in reply.text.split("\n") if line.startswith("data: {")]


async def status_of(client: httpx.AsyncClient, response_id: str) -> str:
    return str((await client.get(f"/v1/responses/{response_id}")).json()["status"])


async def test_a_background_response_runs_detached_and_its_stream_resumes_from_a_sequence_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A stream nobody reads is stopped as abandoned at the next check: checks every 10 ms make that quick to see.
    monkeypatch.setattr(live_sessions, "WATCH_PERIOD", 0.01)
    engine = AsciiEngine("hello", gate=asyncio.Event())
    async with client_for(engine) as client, asyncio.timeout(30):
        started = await client.post("/v1/responses", json={"model": "scripted", "input": "hi", "background": True})
        assert started.status_code == 200, started.text
        first = started.json()
        assert (first["status"], first["background"], first["output"]) == ("in_progress", True, [])
        await engine.started.wait()
        assert await status_of(client, first["id"]) == "in_progress"  # the request has ended; the response runs
        await asyncio.sleep(0.3)  # thirty checks for readers: a response held by nobody would be stopped by now
        assert await status_of(client, first["id"]) == "in_progress"
        engine.gate.set()  # type: ignore[union-attr]

        async def completed() -> bool:
            return await status_of(client, first["id"]) == "completed"

        await eventually(completed, within=20)
        done = (await client.get(f"/v1/responses/{first['id']}")).json()
        assert done["output"][0]["content"][0]["text"] == "hello" and done["background"] is True
        whole = events(await client.get(f"/v1/responses/{first['id']}", params={"stream": "true"}))
        assert [event["sequence_number"] for event in whole] == list(range(len(whole)))
        assert whole[-1]["type"] == "response.completed"
        tail = await client.get(f"/v1/responses/{first['id']}", params={"stream": "true", "starting_after": 3})
        assert tail.text.endswith("data: [DONE]\n\n")
        assert events(tail) == whole[4:]


async def test_a_background_response_is_cancelled_and_says_so() -> None:
    engine = AsciiEngine("never finished", gate=asyncio.Event())
    async with client_for(engine) as client, asyncio.timeout(30):
        first = (
            await client.post("/v1/responses", json={"model": "scripted", "input": "x", "background": True})
        ).json()
        await engine.started.wait()
        cancelled = await client.post(f"/v1/responses/{first['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert await status_of(client, first["id"]) == "cancelled"


async def test_background_needs_storage_and_a_plain_response_is_not_streamed_again() -> None:
    async with client_for(AsciiEngine("x")) as client:
        unstored = await client.post(
            "/v1/responses", json={"model": "scripted", "input": "x", "background": True, "store": False}
        )
        assert unstored.status_code == 400 and unstored.json()["error"]["param"] == "store"
        plain = (await client.post("/v1/responses", json={"model": "scripted", "input": "x"})).json()
        again = await client.get(f"/v1/responses/{plain['id']}", params={"stream": "true"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
