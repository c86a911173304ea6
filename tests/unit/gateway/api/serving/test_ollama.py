"""Ollama's /api over a scripted engine: NDJSON streams by default, the final line's fields, options mapped or
refused, model names with and without ``:latest``, Ollama's error body. The real model and client:
tests/integration/test_ollama_smollm2.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import ollama
import pytest

from gateway.api.errors import InvalidRequest
from gateway.api.protocol.ollama import ChatRequest, Options
from gateway.api.serving.common import ServingConfig
from gateway.api.serving.ollama_translate import chat_request, check_options
from gateway.app import create_app
from tests.helpers.scripted_engine import CharCodec, ScriptedEngine, client_for, content_of
from tests.unit.gateway.api.serving.test_chat_tools import ASK, CALL_TEXT, TOOL, AsciiCodec, TextEngine


class ChatCodec(CharCodec):
    chat_message = staticmethod(content_of)


@dataclass
class ChatEngine(ScriptedEngine):
    codec: CharCodec = field(default_factory=ChatCodec)


def lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


async def test_chat_streams_ndjson_by_default_and_ends_with_the_timings() -> None:
    async with client_for(ChatEngine(script="hello world")) as client:
        response = await client.post(
            "/api/chat", json={"model": "scripted:latest", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
        parts = lines(response.text)
        assert all(part["model"] == "scripted:latest" for part in parts)
        assert [p["done"] for p in parts] == [False] * (len(parts) - 1) + [True]
        assert "".join(p["message"]["content"] for p in parts) == "hello world"
        last = parts[-1]
        assert last["done_reason"] == "length"  # the script ends without an EOS
        for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
            assert isinstance(last[key], int) and last[key] >= 0
        assert last["prompt_eval_count"] == 2 and last["eval_count"] == len("hello world")
        assert last["total_duration"] >= last["prompt_eval_duration"] + last["eval_duration"]

        whole = await client.post(
            "/api/chat", json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": False}
        )
        body = whole.json()
        assert body["done"] is True and body["message"] == {"role": "assistant", "content": "hello world"}


async def test_generate_ends_at_eos_and_returns_the_context() -> None:
    async with client_for(ChatEngine(script="ab<cd")) as client:
        body = (await client.post("/api/generate", json={"model": "scripted", "prompt": "xy", "stream": False})).json()
        assert body["response"] == "ab" and body["done_reason"] == "stop" and body["context"] == [24, 25]
        raw = (
            await client.post("/api/generate", json={"model": "scripted", "prompt": "xy", "raw": True, "stream": False})
        ).json()
        assert raw["response"] == "ab"
        loaded = (await client.post("/api/generate", json={"model": "scripted"})).json()
        assert loaded["done"] is True and loaded["done_reason"] == "load"


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "a"}]}, 404, "model 'nope' not found"),
        ({"model": "scripted:7b", "messages": [{"role": "user", "content": "a"}]}, 404, "not found"),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": "a"}], "options": {"mirostat": 2}},
            400,
            "mirostat",
        ),
        (
            {"model": "scripted", "messages": [{"role": "user", "content": "a"}], "options": {"num_ctx": 100000}},
            400,
            "num_ctx",
        ),
        ({"model": "scripted", "messages": [{"role": "user", "content": "a", "images": ["AAAA"]}]}, 400, "images"),
        ({"model": "scripted", "messages": [{"role": "user", "content": "a"}], "think": True}, 400, "thinking"),
        ({"model": "scripted", "messages": "hi"}, 400, "messages"),
    ],
)
async def test_errors_are_ollamas_shape(body: dict[str, Any], status: int, fragment: str) -> None:
    async with client_for(ChatEngine()) as client:
        response = await client.post("/api/chat", json=body)
        assert response.status_code == status
        error = response.json()
        assert set(error) == {"error"} and fragment in error["error"], error


def test_options_map_onto_sampling_and_neutral_ones_pass() -> None:
    body = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a"}],
            "format": {"type": "object"},
            "options": {
                "temperature": 0.2,
                "top_k": 5,
                "repeat_penalty": 1.2,
                "repeat_last_n": -1,
                "num_predict": 9,
                "stop": ["x"],
                "seed": 3,
                "num_thread": 4,
                "typical_p": 1.0,
            },
        }
    )
    check_options(body.options, 100)
    request = chat_request(body, "m", None)
    assert (request.temperature, request.top_k, request.repetition_penalty) == (0.2, 5, 1.2)
    assert request.max_tokens == 9 and request.stop == ["x"] and request.seed == 3
    assert request.response_format is not None and request.response_format.json_schema is not None
    with pytest.raises(InvalidRequest, match="repeat_last_n"):
        check_options(Options.model_validate({"repeat_penalty": 1.1, "repeat_last_n": 64}), 100)
    with pytest.raises(InvalidRequest, match="typical_p"):
        check_options(Options.model_validate({"typical_p": 0.5}), 100)


async def test_tags_show_ps_version() -> None:
    async with client_for(ChatEngine()) as client:
        assert (await client.get("/api/version")).json()["version"]
        shown = await client.post("/api/show", json={"model": "nope"})
        assert shown.status_code == 404 and shown.json() == {"error": "model 'nope' not found"}


def ollama_client(engine: TextEngine) -> ollama.AsyncClient:
    app = create_app(engine, ServingConfig("m"))
    return ollama.AsyncClient(host="http://gateway", transport=httpx.ASGITransport(app=app))


async def test_a_tool_call_reaches_the_official_client_with_object_arguments() -> None:
    engine = TextEngine(CALL_TEXT, AsciiCodec(""))
    client = ollama_client(engine)
    answer = await client.chat(model="m:latest", messages=ASK, tools=[TOOL])
    assert answer.message.content == "Sure."
    calls = answer.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert answer.done_reason == "stop"
    parts = [part async for part in await client.chat(model="m", messages=ASK, tools=[TOOL], stream=True)]
    streamed = [call for part in parts for call in part.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [("get_weather", {"city": "Paris"})]
    assert "".join(part.message.content or "" for part in parts) == "Sure." and parts[-1].done


async def test_think_splits_the_reasoning_into_thinking() -> None:
    engine = TextEngine("<think>hmm</think>It is 4.", AsciiCodec("{{ '</think>' }}"))
    answer = await ollama_client(engine).chat(model="m", messages=ASK, think=True)
    assert (answer.message.thinking, answer.message.content) == ("hmm", "It is 4.")
    assert engine.codec.rendered[-1][2] == {"enable_thinking": True}
    generated = await ollama_client(engine).generate(model="m", prompt="2+2?", think=True)
    assert (generated.thinking, generated.response) == ("hmm", "It is 4.")


async def test_errors_answered_before_the_route_runs_are_in_ollamas_shape_too() -> None:
    """A refused API key (auth runs before the route) and an unknown /api path: ``{"error": "..."}``, never
    OpenAI's envelope, with the status kept; the official client raises its ResponseError with that status."""
    from gateway.api.auth import Authenticator

    app = create_app(
        ChatEngine(), ServingConfig("scripted"), authenticator=Authenticator(["sk-right"], None, enabled=True)
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        wrong = await client.post(
            "/api/chat",
            json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer sk-wrong"},
        )
        assert wrong.status_code == 401
        body = wrong.json()
        assert isinstance(body["error"], str) and body["error"] and set(body) == {"error"}
        missing = await client.get("/api/nothing-here", headers={"Authorization": "Bearer sk-right"})
        assert missing.status_code == 404 and isinstance(missing.json()["error"], str)
        openai_path = await client.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        assert openai_path.status_code == 401 and openai_path.json()["error"]["code"] == "invalid_api_key"
    official = ollama.AsyncClient(host="http://gateway", transport=transport, headers={"Authorization": "Bearer x"})
    with pytest.raises(ollama.ResponseError) as refused:
        await official.chat(model="scripted", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert refused.value.status_code == 401
