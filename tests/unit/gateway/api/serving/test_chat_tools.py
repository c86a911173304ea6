"""The chat serving layer's side of tools, structured outputs and reasoning, through HTTP with a text-scripting
engine (a seam: the real engine and model are exercised in tests/integration/test_structured_outputs.py).

What it pins: the grammar a request turns into, the template inputs (tools, our default tools prompt, earlier calls,
tool results, chat_template_kwargs), and that a stream's reasoning / content / tool-call deltas add up to the
non-streamed message.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest
from tests.helpers.scripted_engine import WholeSwarm, sse_data

EOS = 0


class AsciiCodec:
    """Token i is chr(i) for printable ASCII; token 0 is EOS."""

    vocab_size = 128

    def __init__(self, template: str) -> None:
        self.template = template
        self.rendered: list[tuple[list[dict[str, Any]], Any, dict[str, Any] | None]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text if 0 < ord(c) < 128]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids if t)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def chat_template(self) -> str | None:
        return self.template

    def render_chat(self, messages: list[dict[str, Any]], tools: Any = None, template_kwargs: Any = None) -> str:
        self.rendered.append((messages, tools, template_kwargs))
        return "".join(str(m["content"]) for m in messages) or "x"

    def fim_ids(self) -> tuple[int, int, int] | None:
        return None


@dataclass
class TextEngine(WholeSwarm):
    """Writes ``text`` one character per token, then EOS; keeps every request it was given."""

    text: str
    codec: AsciiCodec
    requests: list[GenerationRequest] = field(default_factory=list)
    model_name: str = "m"
    context_length: int = 4096

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        self.requests.append(request)
        for char in self.text[: request.max_new_tokens]:
            yield GeneratedToken(ord(char), False, -0.5)
        if len(self.text) < request.max_new_tokens:
            yield GeneratedToken(EOS, True, -0.1)


def client(engine: TextEngine, **config: Any) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig("m", **config))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
ASK = [{"role": "user", "content": "weather?"}]
CALL_TEXT = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def stream_totals(response: httpx.Response) -> tuple[str, str, list[dict[str, str]], str | None]:
    content = reasoning = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for data in sse_data(response):
        if data == "[DONE]":
            continue
        choice = json.loads(data)["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            if call["index"] not in calls:
                assert call["id"] and call["type"] == "function" and call["function"]["name"]
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


async def test_auto_tool_calls_parse_and_stream_the_same() -> None:
    engine = TextEngine(CALL_TEXT, AsciiCodec("no tool support here"))
    body = {"model": "m", "messages": ASK, "tools": [TOOL]}
    async with client(engine) as http:
        whole = (await http.post("/v1/chat/completions", json=body)).json()
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    content, _, calls, finish = stream_totals(streamed)
    assert content == "Sure." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert engine.requests[0].grammar is None  # auto: the model writes freely


async def test_a_template_without_tools_gets_the_default_prompt_and_plain_messages() -> None:
    codec = AsciiCodec("plain template")
    engine = TextEngine("ok", codec)
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"P"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    async with client(engine) as http:
        response = await http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "tools": [TOOL]})
    assert response.status_code == 200, response.text
    rendered, tools, _ = codec.rendered[-1]
    assert tools is None
    assert rendered[0]["role"] == "system" and "<tool_call>" in rendered[0]["content"]
    assert "get_weather" in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}</tool_call>',
    }
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


async def test_a_template_with_tools_gets_them_natively() -> None:
    codec = AsciiCodec("{% for tool in tools %}{% endfor %}<tool_call>")
    engine = TextEngine("ok", codec)
    messages = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    body = {"model": "m", "messages": messages, "tools": [TOOL], "chat_template_kwargs": {"enable_thinking": False}}
    async with client(engine) as http:
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    rendered, tools, kwargs = codec.rendered[-1]
    assert tools == [{"type": "function", "function": {**TOOL["function"], "description": ""}}]  # type: ignore[dict-item]
    assert rendered[1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]
    assert rendered[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("fields", "kind", "needle"),
    [
        ({"tool_choice": "required", "tools": [TOOL]}, "lark", "get_weather"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "tools": [TOOL]},
            "lark",
            "<tool_call>",
        ),
        ({"response_format": {"type": "json_object"}}, "json_schema", '"object"'),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
            "json_schema",
            "integer",
        ),
    ],
)
async def test_what_the_output_must_be_becomes_the_requests_grammar(
    fields: dict[str, Any], kind: str, needle: str
) -> None:
    engine = TextEngine("{}", AsciiCodec(""))
    async with client(engine) as http:
        response = await http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "n": 2, **fields})
    assert response.status_code == 200, response.text
    assert len(engine.requests) == 2  # every choice runs under the grammar
    for request in engine.requests:
        assert request.grammar is not None and request.grammar.kind == kind and needle in request.grammar.source


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [TOOL]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # a call is required, and there is nothing to call
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"response_format": {"type": "grammar"}}, "response_format.type"),
    ],
)
async def test_bad_tool_and_format_requests_are_400s(fields: dict[str, Any], param: str) -> None:
    async with client(TextEngine("", AsciiCodec(""))) as http:
        response = await http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, **fields})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_every_chunk_of_a_chat_stream_carries_the_responses_one_created(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count(1_800_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))  # a second passes at every look at the clock
    body = {"model": "m", "messages": ASK, "stream": True, "stream_options": {"include_usage": True}}
    async with client(TextEngine("hello", AsciiCodec("template"))) as http:
        streamed = await http.post("/v1/chat/completions", json=body)
    chunks = [json.loads(data) for data in sse_data(streamed)[:-1]]
    assert len(chunks) > 3 and len({chunk["created"] for chunk in chunks}) == 1


async def test_a_call_cut_short_by_the_length_limit_is_in_the_response_as_it_was_streamed() -> None:
    engine = TextEngine(CALL_TEXT, AsciiCodec("no tool support here"))
    body = {"model": "m", "messages": ASK, "tools": [TOOL], "max_tokens": CALL_TEXT.index("aris")}
    async with client(engine) as http:
        whole = (await http.post("/v1/chat/completions", json=body)).json()
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
    choice = whole["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert choice["finish_reason"] == "length" and calls == [("get_weather", '{"city": "P')]
    content, _, streamed_calls, finish = stream_totals(streamed)
    assert (content, finish) == ("Sure.", "length")
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == calls
    # Chunks carry something: no empty deltas while the call's markup is held back (the first and last are OpenAI's).
    chunks = [json.loads(data)["choices"][0] for data in sse_data(streamed)[:-1]]
    assert all(chunk["delta"] for chunk in chunks[1:-1]) and chunks[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("choice", ["auto", "none"])
async def test_a_tool_choice_that_requires_no_call_is_fine_without_tools(choice: str) -> None:
    async with client(TextEngine("hi", AsciiCodec(""))) as http:
        response = await http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "tool_choice": choice})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "hi"


@pytest.mark.parametrize("parser", ["auto", "qwen3"])
async def test_reasoning_is_split_from_content_in_both_shapes(parser: str) -> None:
    engine = TextEngine("<think>a < b, so</think>\n\nThe answer.", AsciiCodec("{{ '</think>' }}"))
    body = {"model": "m", "messages": ASK}
    async with client(engine, reasoning_parser=parser) as http:
        whole = (await http.post("/v1/chat/completions", json=body)).json()
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "a < b, so" and message["content"] == "The answer."
    content, reasoning, _, finish = stream_totals(streamed)
    assert (reasoning, content, finish) == ("a < b, so", "The answer.", "stop")


async def test_no_reasoning_parser_leaves_the_tags_in_the_content() -> None:
    engine = TextEngine("<think>x</think>y", AsciiCodec("{{ '</think>' }}"))
    async with client(engine, reasoning_parser="none") as http:
        whole = (await http.post("/v1/chat/completions", json={"model": "m", "messages": ASK})).json()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y", "refusal": None}
