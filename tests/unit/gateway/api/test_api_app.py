"""The HTTP layer over a scripted engine (a seam, in a unit test): failures map to OpenAI's envelope and statuses.

The real engine over real nodes is exercised in tests/integration/test_http_api.py; here the engine misbehaves on
purpose — crashes with internals in the message, swarm errors before and after a stream starts.
"""

from __future__ import annotations

import json
import logging

import pytest

from shared.errors import CacheFull, MissingBlocks, NodeUnreachable, PositionOutOfRange
from tests.helpers.scripted_engine import ScriptedEngine, client_for, completion, sse_data


async def test_an_unexpected_error_is_a_500_without_internals_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    engine = ScriptedEngine(failure=RuntimeError("secret path /srv/weights and a stack"))
    with caplog.at_level(logging.ERROR):
        async with client_for(engine) as client:
            response = await client.post("/v1/completions", json=completion())
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "message": "The server had an error while processing your request.",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (MissingBlocks([3, 4, 5]), "missing_blocks"),
        (CacheFull("no room"), "swarm_unavailable"),
        (PositionOutOfRange("session longer than this node allows"), "swarm_unavailable"),
    ],
)
async def test_swarm_errors_before_the_first_token_are_503_even_when_streaming(failure: Exception, code: str) -> None:
    async with client_for(ScriptedEngine(failure=failure)) as client:
        for stream in (False, True):
            response = await client.post("/v1/completions", json=completion(stream=stream))
            assert response.status_code == 503
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["code"] == code
            assert response.json()["error"]["type"] == "service_unavailable"


async def test_an_error_after_the_stream_started_is_a_final_event_then_done() -> None:
    engine = ScriptedEngine(failure=NodeUnreachable("lost node"), fail_at=4)
    async with client_for(engine) as client:
        response = await client.post("/v1/completions", json=completion(stream=True))
    assert response.status_code == 200
    data = sse_data(response)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "swarm_unavailable"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-2]) == "hell"


async def test_choices_run_concurrently_and_a_stop_string_ends_each_generation_early() -> None:
    engine = ScriptedEngine()
    async with client_for(engine) as client:
        response = await client.post("/v1/completions", json=completion(n=3, stop="o w"))
    assert [c["text"] for c in response.json()["choices"]] == ["hell"] * 3
    assert engine.most_active == 3 and engine.closed_early == 3 and engine.active == 0


async def test_validation_is_400_never_422() -> None:
    async with client_for(ScriptedEngine()) as client:
        bad = [
            completion(n="two"),
            completion(top_p=1.5),
            {"prompt": "ab"},
            completion(logprobs=21),
            completion(stream_options={"include_usage": "maybe"}),
        ]
        for body in bad:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["type"] == "invalid_request_error"
        response = await client.post("/v1/completions", content=b"[1, 2", headers={"content-type": "application/json"})
        assert (response.status_code, response.json()["error"]["code"]) == (400, "invalid_json")


async def test_a_model_without_chat_template_answers_chat_with_400() -> None:
    async with client_for(ScriptedEngine()) as client:
        body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
        both = await client.post("/tokenize", json={"prompt": "ab", "messages": body["messages"]})
        assert both.status_code == 400


async def test_fields_that_change_nothing_are_ignored_and_usage_counts_tokens() -> None:
    harmless = {"user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    async with client_for(ScriptedEngine()) as client:
        response = await client.post("/v1/completions", json=completion(max_tokens=5, **harmless))
    body = response.json()
    assert body["choices"][0]["text"] == "hello" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert response.headers["x-session-id"] == body["id"]


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", "some_vendor_field"),
        ("/v1/completions", "guided_json"),
        ("/v1/chat/completions", "functions"),
        ("/v1/chat/completions", "audio"),
        ("/v1/chat/completions", "reasoning_effort"),
    ],
)
async def test_a_field_that_would_change_the_result_and_is_not_implemented_is_a_400_naming_it(
    path: str, field: str
) -> None:
    chat = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    body: dict[str, object] = completion() if path == "/v1/completions" else chat
    async with client_for(ScriptedEngine()) as client:
        response = await client.post(path, json={**body, field: {"x": 1}})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_parameter"
    assert response.json()["error"]["param"] == field
