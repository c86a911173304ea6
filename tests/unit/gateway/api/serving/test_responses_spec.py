"""/v1/responses as the Open Responses specification writes it, over a scripted engine: the response object's required
fields with the values actually applied, bookkeeping fields accepted, assistant ``phase``, a text-only model's
refusal of images, and stream lines that end with LF as every stream of ours (read as raw bytes)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from tests.helpers.ascii_engine import AsciiEngine
from tests.helpers.open_responses import check_item, check_resource


def client_for(engine: AsciiEngine, **config: Any) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig(engine.model_name, **config))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "scripted", "input": "hi", **fields}


async def test_every_required_field_with_the_sampling_actually_applied() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9}  # the model's generation_config.json
    async with client_for(AsciiEngine("hello"), sampling_defaults=defaults) as client:
        plain = (await client.post("/v1/responses", json=body())).json()
        check_resource(plain)
        assert (plain["temperature"], plain["top_p"]) == (0.6, 0.9)
        assert (plain["presence_penalty"], plain["frequency_penalty"], plain["top_logprobs"]) == (0, 0, 0)
        assert plain["status"] == "completed" and plain["completed_at"] >= plain["created_at"]
        assert plain["max_output_tokens"] == 4096 - 2  # the rest of the context window: what it could write
        asked = body(temperature=0.2, top_p=0.5, presence_penalty=0.5, frequency_penalty=-0.5, max_output_tokens=9)
        applied = (await client.post("/v1/responses", json=asked)).json()
        check_resource(applied)
        assert (applied["temperature"], applied["top_p"], applied["max_output_tokens"]) == (0.2, 0.5, 9)
        assert (applied["presence_penalty"], applied["frequency_penalty"]) == (0.5, -0.5)


async def test_a_response_cut_by_the_gateways_default_cap_names_that_cap() -> None:
    async with client_for(AsciiEngine("a long answer"), default_max_tokens=4) as client:
        cut = (await client.post("/v1/responses", json=body())).json()
    check_resource(cut)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["max_output_tokens"] == 4 and cut["usage"]["output_tokens"] == 4
    assert cut["completed_at"] is None  # it did not complete
    assert cut["output"][0]["content"][0]["text"] == "a lo"


async def test_codex_bookkeeping_fields_are_accepted_and_echoed_where_the_api_keeps_them() -> None:
    codex_like = body(
        client_metadata={"x-codex-installation-id": "abc"},
        prompt_cache_key="thread-1",
        safety_identifier="user-7",
        service_tier="auto",
        metadata={"k": "v"},
        store=False,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "medium", "summary": "auto"},  # a model that does not think: nothing to set
        text={"verbosity": "low"},
        max_tool_calls=3,
        stream_options={"include_obfuscation": False},
        prompt_cache_retention="24h",
    )
    async with client_for(AsciiEngine("ok")) as client:
        response = await client.post("/v1/responses", json=codex_like)
        assert response.status_code == 200, response.text
        echoed = response.json()
        check_resource(echoed)
        assert (echoed["prompt_cache_key"], echoed["safety_identifier"]) == ("thread-1", "user-7")
        assert echoed["metadata"] == {"k": "v"} and echoed["max_tool_calls"] == 3 and echoed["store"] is False
        assert echoed["reasoning"] == {"effort": "medium", "summary": "auto"}
        for refused in ({"include": ["file_search_call.results"]}, {"unknown_knob": 1}):
            answer = await client.post("/v1/responses", json=body(**refused))
            assert answer.status_code == 400 and answer.json()["error"]["param"] == next(iter(refused)), answer.text


async def test_reasoning_effort_is_refused_on_a_model_that_thinks() -> None:
    async with client_for(AsciiEngine("ok"), reasoning_parser="qwen3") as client:
        response = await client.post("/v1/responses", json=body(reasoning={"effort": "high"}))
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": "'reasoning' is not supported by this server.",
            "type": "invalid_request_error",
            "param": "reasoning",
            "code": "unsupported_parameter",
        }
        default = await client.post("/v1/responses", json=body(reasoning={"effort": "none"}))
        assert default.status_code == 200


TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def test_assistant_phase_commentary_before_tool_calls_and_final_answer_at_the_end() -> None:
    async with client_for(AsciiEngine("Let me look.\n" + CALL)) as client:
        calling = (await client.post("/v1/responses", json=body(tools=[TOOL]))).json()
        streamed = await client.post("/v1/responses", json=body(tools=[TOOL], stream=True))
    async with client_for(AsciiEngine("Done.")) as client:
        final = (await client.post("/v1/responses", json=body())).json()
    message, call = calling["output"]
    assert (message["type"], message["phase"], call["type"]) == ("message", "commentary", "function_call")
    assert final["output"][0]["phase"] == "final_answer"
    events = [json.loads(line[6:]) for line in streamed.text.split("\n") if line.startswith("data: {")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "message"]
    assert [item["phase"] for item in done] == ["commentary"]


@pytest.mark.parametrize("part", [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}])
async def test_images_on_a_text_model_are_a_clear_400(part: dict[str, Any]) -> None:
    item = {"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, part]}
    async with client_for(AsciiEngine("x")) as client:
        response = await client.post("/v1/responses", json=body(input=[item]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_value", "input")
    assert "reads text only" in error["message"] and "input_image" in error["message"]


CHAT_MESSAGE = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        ("/v1/responses", body(stream=True)),
        ("/v1/chat/completions", {"model": "scripted", "messages": [CHAT_MESSAGE], "stream": True}),
        ("/v1/completions", {"model": "scripted", "prompt": "hi", "stream": True}),
    ],
)
async def test_stream_lines_end_with_lf_only(path: str, request_body: dict[str, Any]) -> None:
    async with client_for(AsciiEngine("hello")) as client, client.stream("POST", path, json=request_body) as reply:
        raw = b"".join([chunk async for chunk in reply.aiter_raw()])
    assert reply.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert b"\r" not in raw
    blocks = [block for block in raw.decode().split("\n\n") if block]
    assert len(blocks) > 2 and all(block.count("data: ") == 1 for block in blocks)


async def test_each_responses_event_is_named_for_its_type() -> None:
    async with client_for(AsciiEngine("hello")) as client:
        reply = await client.post("/v1/responses", json=body(stream=True))
    blocks = [block.split("\n") for block in reply.text.split("\n\n") if "data: {" in block]
    for lines in blocks:
        event = next(line[7:] for line in lines if line.startswith("event: "))
        data = json.loads(next(line[6:] for line in lines if line.startswith("data: ")))
        assert event == data["type"]
    assert len(blocks) >= 8


NAMESPACE = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents",
    "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
}
SPAWN = '<tool_call>\n{"name": "agents.spawn", "arguments": {"task": "x"}}\n</tool_call>'


async def test_a_namespace_tools_functions_are_called_by_name_and_namespace() -> None:
    engine = AsciiEngine(SPAWN)
    async with client_for(engine) as client:
        called = (await client.post("/v1/responses", json=body(tools=[NAMESPACE]))).json()
        (call,) = called["output"]
        assert (call["type"], call["name"], call["namespace"]) == ("function_call", "spawn", "agents")
        assert json.loads(call["arguments"]) == {"task": "x"}
        assert called["tools"] == [NAMESPACE]  # echoed as sent
        replay = {**call, "status": "completed"}
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "spawned"}
        follow = body(input=[replay, result], tools=[NAMESPACE])
        assert (await client.post("/v1/responses", json=follow)).status_code == 200
        prompt = engine.codec.decode(engine.requests[-1].prompt_ids)
        assert '"name": "agents.spawn"' in prompt and prompt.index("agents.spawn") < prompt.index("spawned")
        inner_custom = {**NAMESPACE, "tools": [{"type": "custom", "name": "apply_patch"}]}
        refused = await client.post("/v1/responses", json=body(tools=[inner_custom]))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}  # no description, no strict
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}


@pytest.mark.parametrize("stream", [False, True])
async def test_tools_and_text_format_are_echoed_with_every_field_the_spec_requires(stream: bool) -> None:
    """The spec's FunctionTool requires description, parameters and strict (null allowed) and its json_schema format
    description and strict: a tool or format echoed with them left out fails its schema (checked from outside with
    the spec's openapi.json)."""
    json_schema = {"type": "json_schema", "name": "c", "schema": SCHEMA, "strict": False}
    asked = body(tools=[WEATHER], text={"format": json_schema}, stream=stream)
    async with client_for(AsciiEngine('{"colour":"red"}')) as client:
        reply = await client.post("/v1/responses", json=asked)
        plain = (await client.post("/v1/responses", json=body(stream=stream))).json() if not stream else None
    if stream:
        events = [json.loads(line[6:]) for line in reply.text.split("\n") if line.startswith("data: {")]
        response = next(e["response"] for e in events if e["type"] == "response.completed")
        assert events[0]["response"]["tools"] == response["tools"]
    else:
        response = reply.json()
        check_resource(plain)
        assert plain["text"] == {"format": {"type": "text"}}
    check_resource(response)
    assert response["tools"] == [{**WEATHER, "description": None, "strict": None}]
    # strict as applied: the grammar holds the text to the schema whatever the request said
    assert response["text"]["format"] == {**json_schema, "description": None, "strict": True}


async def test_a_streamed_message_item_has_no_phase_until_it_is_known() -> None:
    """The spec's Message.phase is one of its values or absent: ``output_item.added`` (phase not known yet) leaves it
    out rather than sending null; ``output_item.done`` names it."""
    async with client_for(AsciiEngine("hello")) as client:
        reply = await client.post("/v1/responses", json=body(stream=True))
    events = [json.loads(line[6:]) for line in reply.text.split("\n") if line.startswith("data: {")]
    items = {e["type"]: e["item"] for e in events if e["type"].startswith("response.output_item.")}
    for item in items.values():
        check_item(item)
    assert "phase" not in items["response.output_item.added"]
    assert items["response.output_item.done"]["phase"] == "final_answer"
