"""/v1/responses with ``include: ["message.output_text.logprobs"]`` over a scripted engine: the message text's
tokens with their logprobs and ``top_logprobs`` alternatives, on the output_text part, each delta event and the done
event, the same streamed and not; none without the include (as OpenAI: ``top_logprobs`` alone returns none); and
none for the tokens that wrote reasoning or a tool call."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest
from tests.helpers.ascii_engine import AsciiEngine
from tests.helpers.open_responses import check_resource

INCLUDE = ["message.output_text.logprobs"]
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@dataclass
class RankedEngine(AsciiEngine):
    """Each token at logprob -0.25 with, as alternatives, itself and "z" at -3.5 (as many as the request asks)."""

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        async for event in super().stream(request):
            if isinstance(event, GeneratedToken) and not event.eos:
                top = ((event.token_id, -0.25), (ord("z"), -3.5))[: request.logprobs or 0]
                event = GeneratedToken(event.token_id, False, -0.25, top)
            yield event


def client_for(engine: AsciiEngine, **config: Any) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig(engine.model_name, **config))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "scripted", "input": "hi", **fields}


def events_of(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: {")]


def entry(char: str, top: int) -> dict[str, Any]:
    alternatives = [(char, -0.25), ("z", -3.5)][:top]
    shown = [{"token": t, "logprob": p, "bytes": list(t.encode())} for t, p in alternatives]
    return {"token": char, "logprob": -0.25, "bytes": list(char.encode()), "top_logprobs": shown}


@pytest.mark.parametrize("top", [0, 2])
async def test_the_message_text_carries_each_tokens_logprob_streamed_and_not(top: int) -> None:
    engine = RankedEngine("Hi there")
    async with client_for(engine) as client:
        whole = (await client.post("/v1/responses", json=body(include=INCLUDE, top_logprobs=top))).json()
        streamed = await client.post("/v1/responses", json=body(include=INCLUDE, top_logprobs=top, stream=True))
    expected = [entry(char, top) for char in "Hi there"]
    check_resource(whole)
    assert whole["top_logprobs"] == top and whole["output"][0]["content"][0]["logprobs"] == expected
    events = events_of(streamed)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp for e in deltas for lp in e["logprobs"]] == expected
    assert all(len(e["logprobs"]) == len(e["delta"]) for e in deltas)  # a delta's own tokens (one char each here)
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == expected
    completed = next(e for e in events if e["type"] == "response.completed")["response"]
    assert completed["output"][0]["content"][0]["logprobs"] == expected
    assert all(request.logprobs == top for request in engine.requests)


async def test_without_the_include_there_are_no_logprobs_even_with_top_logprobs() -> None:
    engine = RankedEngine("Hi")
    async with client_for(engine) as client:
        answer = (await client.post("/v1/responses", json=body(top_logprobs=3))).json()
        streamed = await client.post("/v1/responses", json=body(top_logprobs=3, stream=True))
    assert answer["top_logprobs"] == 3 and answer["output"][0]["content"][0]["logprobs"] == []
    assert all(e["logprobs"] == [] for e in events_of(streamed) if e["type"] == "response.output_text.delta")
    assert all(request.logprobs is None for request in engine.requests)  # not computed at all


@pytest.mark.parametrize("stream", [False, True])
async def test_the_tokens_of_a_tool_call_give_the_message_no_logprobs(stream: bool) -> None:
    engine = RankedEngine("Let me look.\n" + CALL)
    async with client_for(engine) as client:
        answer = await client.post("/v1/responses", json=body(include=INCLUDE, tools=[TOOL], stream=stream))
    response = (
        next(e for e in events_of(answer) if e["type"] == "response.completed")["response"]
        if stream
        else (answer.json())
    )
    message, call = response["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    text = message["content"][0]["text"]
    assert [lp["token"] for lp in message["content"][0]["logprobs"]] == list(text)
    assert text.strip() == "Let me look."


@pytest.mark.parametrize("stream", [False, True])
async def test_the_tokens_of_the_reasoning_give_the_message_no_logprobs(stream: bool) -> None:
    engine = RankedEngine("<think>\nsunny?\n</think>\n\nIt is sunny.")
    async with client_for(engine, reasoning_parser="qwen3") as client:
        answer = await client.post("/v1/responses", json=body(include=INCLUDE, stream=stream))
    response = (
        next(e for e in events_of(answer) if e["type"] == "response.completed")["response"]
        if stream
        else (answer.json())
    )
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and "sunny?" in reasoning["content"][0]["text"]
    text = message["content"][0]["text"]
    assert text.strip() == "It is sunny."
    assert "".join(lp["token"] for lp in message["content"][0]["logprobs"]) == text
