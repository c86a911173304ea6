"""/v1/messages over a scripted engine (a seam): the translation to a chat request, the content blocks and the exact
stream event sequence, stop reasons, count_tokens, and Anthropic's error body. Real processes and the anthropic SDK:
tests/integration/test_messages_smollm2.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gateway.api.auth import Authenticator
from gateway.api.errors import InvalidRequest
from gateway.api.protocol.common import UnsupportedParameter
from gateway.api.protocol.messages import MessagesRequest, MessageUsage
from gateway.api.serving.common import ServingConfig
from gateway.api.serving.messages_events import MessageWriter
from gateway.api.serving.messages_translate import chat_request
from gateway.app import create_app
from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest
from gateway.text.chat_output import ChatOutputParser
from gateway.text.tool_parsers import FORMATS
from shared.errors import NodeUnreachable
from tests.helpers.scripted_engine import CharCodec, ScriptedEngine


class AnyCharCodec(CharCodec):
    """Token i is ``chr(i)`` (0 is EOS); a chat is its messages as ``role: content`` lines."""

    vocab_size = 256
    template: str | None = "a template"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text if 0 < ord(c) < 256]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids if t != 0)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def chat_template(self) -> str | None:
        return self.template

    def render_chat(self, messages: list[dict[str, Any]], tools: Any = None, template_kwargs: Any = None) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


@dataclass
class TextEngine(ScriptedEngine):
    """Writes ``script`` one character per token, then an EOS (unless max_tokens ends it first)."""

    requests: list[GenerationRequest] = field(default_factory=list)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        self.requests.append(request)
        for produced, char in enumerate(self.script[: request.max_new_tokens]):
            if self.failure is not None and produced == self.fail_at:
                raise self.failure
            await asyncio.sleep(0)
            yield GeneratedToken(ord(char), False, -0.1)
        if len(self.script) < request.max_new_tokens:
            yield GeneratedToken(0, True, -0.1)


def engine(script: str = "Hello there.", **kwargs: Any) -> TextEngine:
    return TextEngine(script=script, codec=AnyCharCodec(), context_length=200, **kwargs)


def client(engine: TextEngine, keys: Sequence[str] = ()) -> httpx.AsyncClient:
    auth = Authenticator(list(keys), None, enabled=True) if keys else None
    app = create_app(engine, ServingConfig(engine.model_name), authenticator=auth)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "scripted", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], **fields}


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event; the name must be the data's type, as Anthropic sends them."""
    found = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"], block
        found.append((lines["event"], data))
    return found


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind, payload
    assert set(payload) == {"type", "error"} and set(payload["error"]) == {"type", "message"}
    return str(payload["error"]["message"])


# -- translation --------------------------------------------------------------------------------------------------


def test_blocks_become_the_chat_requests_messages() -> None:
    request = MessagesRequest.model_validate(
        body(
            system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "9C"}]},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
                {"role": "assistant", "content": "Tomorrow it"},
            ],
            tools=[{"name": "weather", "description": "Weather now", "input_schema": {"type": "object"}}],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            stop_sequences=["END"],
            temperature=0.5,
            top_k=5,
            thinking={"type": "enabled", "budget_tokens": 1024},
            metadata={"user_id": "u1"},
        )
    )
    translated = chat_request(request)
    chat = translated.chat
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
            "reasoning_content": "use the tool",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "9C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert translated.prefill == "Tomorrow it"  # the last assistant turn: the answer continues it
    assert chat.tools is not None and chat.tools[0].function.parameters == {"type": "object"}
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("auto", False)
    assert (chat.stop, chat.temperature, chat.top_k) == (["END"], 0.5, 5)
    assert chat.chat_template_kwargs == {"enable_thinking": True}


def test_claude_codes_request_shape_is_served() -> None:
    """What Claude Code sends (2.1): system blocks, a mid-conversation system message, adaptive thinking, effort,
    a no-op context edit, tools with examples; and a thinking edit that keeps only the last turn's thinking."""
    thought = {"type": "thinking", "thinking": "plan", "signature": "s"}
    fields = body(
        system=[{"type": "text", "text": "You are Claude Code."}],
        messages=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [thought, {"type": "text", "text": "b"}]},
            {"role": "system", "content": "Reminder: be brief."},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": [thought, {"type": "text", "text": "d"}]},
            {"role": "user", "content": "e"},
        ],
        max_tokens=32000,
        thinking={"type": "adaptive"},
        output_config={"effort": "high"},
        context_management={
            "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]
        },
        tools=[
            {
                "name": "Read",
                "description": "Read a file.",
                "input_schema": {"type": "object"},
                "input_examples": [{"path": "a"}],
            }
        ],
    )
    chat = chat_request(MessagesRequest.model_validate(fields)).chat
    roles = [(m.role, m.content, m.reasoning_content) for m in chat.messages]
    assert roles == [
        ("system", "You are Claude Code.", None),
        ("user", "a", None),
        ("assistant", "b", None),  # its thinking cleared: only the last turn keeps it
        ("system", "Reminder: be brief.", None),
        ("user", "c", None),
        ("assistant", "d", "plan"),
        ("user", "e", None),
    ]
    assert chat.chat_template_kwargs is None  # adaptive: the template's own default
    assert chat.tools is not None and chat.tools[0].function.description == (
        'Read a file.\n\nExamples of input:\n{"path": "a"}'
    )
    clearing = body(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]})
    with pytest.raises(InvalidRequest) as refused:
        chat_request(MessagesRequest.model_validate(clearing))
    assert refused.value.param == "context_management.edits[0].type"


def test_output_config_format_is_the_chat_paths_json_schema_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fields = body(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "high"})
    chat = chat_request(MessagesRequest.model_validate(fields)).chat
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema is not None and chat.response_format.json_schema.schema_ == schema


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}}),
    ],
)
def test_tool_choice_maps_onto_the_chat_modes(choice: dict[str, Any], expected: Any) -> None:
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    chat = chat_request(MessagesRequest.model_validate(body(tools=tools, tool_choice=choice))).chat
    chosen: Any = chat.tool_choice
    shown = chosen.model_dump() if hasattr(chosen, "model_dump") else chosen
    assert shown == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_a": 1}, "top_a"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "weight": 2}]}]}, "weight"),
        ({"tools": [{"name": "w", "input_schema": {}, "max_calls": 2}]}, "tools[0].max_calls"),
    ],
)
def test_unknown_fields_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(UnsupportedParameter) as refused:
        chat_request(MessagesRequest.model_validate(body(**fields)))
    assert refused.value.param.endswith(param)


# -- content blocks and events ------------------------------------------------------------------------------------


def written(text: str, reasoning: bool = False, tools: bool = False) -> MessageWriter:
    parser = ChatOutputParser.build(reasoning, False, FORMATS["hermes"] if tools else None)
    writer = MessageWriter("msg_1", "m", 3)
    from gateway.api.serving.messages import _Turn, write  # the serving path's own glue

    turn = _Turn(50, 50, writer, None, parser)  # type: ignore[arg-type]  # the record is not read here
    out = parser.feed(text)
    final = parser.finish()
    names = [e["type"] for e in writer.started() + write(turn, out) + write(turn, final)]
    writer.events = names  # type: ignore[attr-defined]  # for the assertions below
    writer.finish("tool_use" if turn.called else "end_turn", None, MessageUsage(input_tokens=3, output_tokens=9))
    return writer


def test_thinking_text_and_a_tool_call_are_blocks_in_order() -> None:
    text = '<think>hmm</think>Checking.\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    writer = written(text, reasoning=True, tools=True)
    message = writer.response().model_dump()
    content = message["content"]
    assert [block["type"] for block in content] == ["thinking", "text", "tool_use"]
    assert content[0] == {"type": "thinking", "thinking": "hmm", "signature": ""}
    assert content[1] == {"type": "text", "text": "Checking.\n"}  # as the chat path's content
    assert content[2]["name"] == "weather" and content[2]["input"] == {"city": "Oslo"}
    assert content[2]["id"].startswith("toolu_")
    assert message["stop_reason"] == "tool_use"


def test_streamed_tool_input_adds_up_to_the_block() -> None:
    parser = ChatOutputParser.build(False, False, FORMATS["hermes"])
    writer = MessageWriter("msg_1", "m", 3)
    from gateway.api.serving.messages import _Turn, write

    turn = _Turn(50, 50, writer, None, parser)  # type: ignore[arg-type]
    text = '<tool_call>{"name": "w", "arguments": {"a": [1, 2], "b": "x"}}</tool_call>'
    emitted = [event for char in text for event in write(turn, parser.feed(char))] + write(turn, parser.finish())
    emitted += writer.finish("tool_use", None, MessageUsage(input_tokens=3, output_tokens=9))
    kinds = [(e["type"], e.get("delta", {}).get("type")) for e in emitted]
    assert kinds[0] == ("content_block_start", None) and kinds[-3:] == [
        ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert set(kinds[1:-3]) == {("content_block_delta", "input_json_delta")}
    partial = "".join(e["delta"]["partial_json"] for e in emitted if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"a": [1, 2], "b": "x"} == writer.response().model_dump()["content"][0]["input"]


# -- over HTTP ----------------------------------------------------------------------------------------------------


async def test_a_message_and_its_stream_agree_event_by_event() -> None:
    async with client(engine()) as http:
        whole = await http.post("/v1/messages", json=body())
        streamed = await http.post("/v1/messages", json=body(stream=True))
    message = whole.json()
    assert whole.headers["x-session-id"] == message["id"] and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "text", "text": "Hello there."}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("end_turn", None)
    assert message["usage"] == {
        "input_tokens": len("user: hi\nassistant: "),
        "output_tokens": len("Hello there.") + 1,  # the end token counts, as on the chat path
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    sequence = events(streamed.text)
    names = [name for name, _ in sequence]
    deltas = len(names) - 6
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = sequence[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"] == streamed.headers["x-session-id"]
    text = "".join(data["delta"]["text"] for name, data in sequence if name == "content_block_delta")
    assert text == "Hello there."
    assert sequence[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert sequence[-2][1]["usage"] == message["usage"]
    assert "[DONE]" not in streamed.text


async def test_stop_reasons_name_what_ended_the_answer() -> None:
    async with client(engine("one two three")) as http:
        stopped = (await http.post("/v1/messages", json=body(stop_sequences=["zz", "two"]))).json()
        cut = (await http.post("/v1/messages", json=body(max_tokens=3))).json()
        # The window (200) leaves less than max_tokens: the answer is bounded by the window, not refused.
        windowed = await http.post("/v1/messages", json=body(max_tokens=100_000))
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "two")
    assert stopped["content"] == [{"type": "text", "text": "one "}]
    assert (cut["stop_reason"], cut["content"]) == ("max_tokens", [{"type": "text", "text": "one"}])
    assert windowed.status_code == 200 and windowed.json()["stop_reason"] == "end_turn"


async def test_max_tokens_zero_answers_empty_at_once() -> None:
    async with client(engine()) as http:
        message = (await http.post("/v1/messages", json=body(max_tokens=0))).json()
    assert (message["content"], message["stop_reason"], message["usage"]["output_tokens"]) == ([], "max_tokens", 0)


async def test_the_context_window_ending_the_answer_says_so() -> None:
    long = engine("x" * 300)
    async with client(long) as http:
        message = (await http.post("/v1/messages", json=body(max_tokens=1000))).json()
    assert message["stop_reason"] == "model_context_window_exceeded"
    assert long.requests[0].max_new_tokens == 200 - len("user: hi\nassistant: ")


async def test_count_tokens_counts_the_prompt_a_message_would_send() -> None:
    fields = {"system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}
    async with client(engine()) as http:
        counted = await http.post("/v1/messages/count_tokens", json={"model": "scripted", **fields})
        message = (await http.post("/v1/messages", json=body(**fields))).json()
    assert counted.json() == {"input_tokens": message["usage"]["input_tokens"]}


async def test_errors_have_anthropics_body_and_status() -> None:
    async with client(engine()) as http:
        missing = await http.post("/v1/messages", json={"model": "scripted", "messages": [{"role": "user"}]})
        image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]
        pictured = await http.post("/v1/messages", json=body(messages=[{"role": "user", "content": image}]))
        server_tool = await http.post("/v1/messages", json=body(tools=[{"type": "web_search_20250305", "name": "s"}]))
        unknown_model = await http.post("/v1/messages", json=body(model="claude-opus-4"))
        no_path = await http.post("/v1/messages/batches", json={})
        too_warm = await http.post("/v1/messages", json=body(temperature=1.5))
        not_json = await http.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert "messages[0].content" in anthropic_error(missing, 400, "invalid_request_error")
    assert "messages[0].content[0].type" in anthropic_error(pictured, 400, "invalid_request_error")
    assert "tools[0].type" in anthropic_error(server_tool, 400, "invalid_request_error")
    assert "claude-opus-4" in anthropic_error(unknown_model, 404, "not_found_error")
    anthropic_error(no_path, 404, "not_found_error")
    assert "temperature" in anthropic_error(too_warm, 400, "invalid_request_error")
    anthropic_error(not_json, 400, "invalid_request_error")


async def test_other_endpoints_keep_openais_errors() -> None:
    async with client(engine()) as http:
        refused = await http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert refused.status_code == 400 and "code" in refused.json()["error"]


async def test_x_api_key_authenticates_like_a_bearer_token() -> None:
    async with client(engine(), keys=["sk-op"]) as http:
        keyed = await http.post("/v1/messages", json=body(), headers={"x-api-key": "sk-op"})
        bearer = await http.post("/v1/messages", json=body(), headers={"authorization": "Bearer sk-op"})
        wrong = await http.post("/v1/messages", json=body(), headers={"x-api-key": "sk-wrong"})
        none = await http.post("/v1/messages/count_tokens", json=body())
        openai_path = await http.get("/v1/models", headers={"x-api-key": "sk-op"})
    assert keyed.status_code == bearer.status_code == openai_path.status_code == 200
    anthropic_error(wrong, 401, "authentication_error")
    anthropic_error(none, 401, "authentication_error")


async def test_a_failure_after_the_start_is_an_error_event_and_the_stream_ends() -> None:
    failing = engine(failure=NodeUnreachable("node gone"), fail_at=4)
    async with client(failing) as http:
        streamed = await http.post("/v1/messages", json=body(stream=True))
    sequence = events(streamed.text)
    assert sequence[-1] == ("error", {"type": "error", "error": sequence[-1][1]["error"]})
    assert sequence[-1][1]["error"]["type"] == "overloaded_error"  # a swarm failure: retry (HTTP 529 unstreamed)
    assert "message_stop" not in [name for name, _ in sequence]


async def test_a_swarm_failure_before_the_start_is_529_overloaded() -> None:
    failing = engine(failure=NodeUnreachable("node gone"), fail_at=0)
    async with client(failing) as http:
        refused = await http.post("/v1/messages", json=body())
        streamed = await http.post("/v1/messages", json=body(stream=True))
    anthropic_error(refused, 529, "overloaded_error")
    anthropic_error(streamed, 529, "overloaded_error")
