"""Structured outputs and tools on the real SmolLM2-135M behind `gateway serve`, through the official openai client.

A 135M model left to itself rarely writes valid JSON or a well-formed tool call; every check here holds because the
gateway's sampler enforces the grammar — at temperature 0 and 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def gateway(smollm2_swarm: LocalSwarm, smollm2_gguf: Path) -> Iterator[Gateway]:
    try:
        # A step that times out bans the only node of its span: give slow steps on a busy box room.
        yield start_gateway(smollm2_swarm, smollm2_gguf, "--step-timeout", "180", timeout=600)
    finally:
        stop_gracefully(smollm2_swarm)


def patient(gateway: Gateway) -> openai.OpenAI:
    """The openai client with room for a busy 2-core box (a constrained request is no slower than another)."""
    http_client = httpx.Client(trust_env=False, timeout=600)
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, http_client=http_client)


def test_parse_with_a_pydantic_model(gateway: Gateway) -> None:
    client = patient(gateway)
    messages = [{"role": "user", "content": "Describe Tokyo as JSON."}]
    for temperature in (0.0, 1.0):
        result = client.chat.completions.parse(
            model=gateway.model, messages=messages, response_format=City, temperature=temperature, max_tokens=120
        )  # type: ignore[call-overload]
        parsed = result.choices[0].message.parsed
        assert isinstance(parsed, City), result.choices[0].message.content


def test_json_schema_strict_at_temperature_zero_and_one(gateway: Gateway) -> None:
    schema = {
        "type": "object",
        "properties": {
            "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "count": {"type": "integer", "minimum": 1, "maximum": 3},
            "note": {"anyOf": [{"type": "string", "maxLength": 15}, {"type": "null"}]},
        },
        "required": ["colours", "count", "note"],
        "additionalProperties": False,
    }
    validator = jsonschema_rs.validator_for(schema)
    response_format = {"type": "json_schema", "json_schema": {"name": "colours", "schema": schema, "strict": True}}
    client = patient(gateway)
    for temperature, n in ((0.0, 1), (1.0, 4)):
        result = client.chat.completions.create(
            model=gateway.model,
            messages=[{"role": "user", "content": "Name some colours."}],
            response_format=response_format,
            temperature=temperature,
            n=n,
            max_tokens=100,
            logprobs=True,
        )  # type: ignore[call-overload]
        assert len(result.choices) == n
        for choice in result.choices:
            validator.validate(json.loads(choice.message.content))
            assert choice.finish_reason == "stop"
            # logprobs are the model's own distribution: not all 0 (which a renormalized, forced mask would show)
            assert any(entry.logprob < -1e-3 for entry in choice.logprobs.content)


def test_json_object_streamed(gateway: Gateway) -> None:
    """Any JSON object: free keys and values, so only a budget ends a rambling one (finish_reason "length", as
    OpenAI's); what ends by itself parses."""
    stream = patient(gateway).chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=300,
        stream=True,
    )  # type: ignore[call-overload]
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


def _streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None]:
    """Tool calls assembled from stream deltas as a client does; checks each call's first delta has id and name."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name, delta
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_stream_the_same_call(gateway: Gateway, choice: Any) -> None:
    client = gateway.openai()
    request = {
        "model": gateway.model,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": 120,
    }
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls, message
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema_rs.validator_for(schemas[call.function.name]).validate(json.loads(call.function.arguments))
    if isinstance(choice, dict):
        assert [call.function.name for call in message.tool_calls] == ["get_time"]

    streamed, finish = _streamed_calls(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (call.function.name, call.function.arguments) for call in message.tool_calls
    ]


def test_a_tool_result_turn(gateway: Gateway) -> None:
    """The assistant's call and the tool's result go back in; the model answers in text (tools still offered)."""
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    client = gateway.openai()
    result = client.chat.completions.create(
        model=gateway.model, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=40
    )  # type: ignore[call-overload]
    message = result.choices[0].message
    assert message.tool_calls is None and message.content
    # The same turn, rendered: the call and its result are in the prompt the model saw.
    tokens = gateway.http().post("/tokenize", json={"model": gateway.model, "messages": messages}).json()
    assert tokens["count"] > 40


def test_unsupported_parameters_are_named(gateway: Gateway) -> None:
    response = gateway.http().post(
        "/v1/chat/completions",
        json={"model": gateway.model, "messages": ASK, "functions": [WEATHER["function"]]},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_parameter"
    assert response.json()["error"]["param"] == "functions"


def test_langchain_structured_output_and_bind_tools(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    monkeypatch.setenv("LANGSMITH_TRACING", "false")  # nothing leaves this machine
    llm = langchain_openai.ChatOpenAI(
        model=gateway.model,
        base_url=f"{gateway.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=120,
        http_client=httpx.Client(trust_env=False, timeout=120),
    )
    city = llm.with_structured_output(City).invoke("Describe Tokyo.")
    assert isinstance(city, City)

    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city (unit: celsius or fahrenheit)."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert set(message.tool_calls[0]["args"]) == {"city", "unit"}
