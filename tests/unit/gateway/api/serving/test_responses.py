"""/v1/responses over the scripted engine (a seam): the translation to a chat request, the event assembly, storage,
previous_response_id, cancel, and the refusals. Real processes and the openai client: tests/integration."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gateway.api.errors import InvalidRequest
from gateway.api.protocol.responses import ResponseObject, ResponsesRequest, ResponseUsage
from gateway.api.serving.common import ServingConfig
from gateway.api.serving.responses_events import ResponseWriter
from gateway.api.serving.responses_translate import chat_fields, chat_request
from gateway.app import create_app
from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest
from shared.errors import NodeUnreachable
from tests.helpers.ascii_engine import AsciiEngine
from tests.helpers.scripted_engine import CharCodec, ScriptedEngine, sse_data


class TemplateCodec(CharCodec):
    """A chat is its messages' contents, one token per character."""

    def render_chat(self, messages: list[dict[str, Any]], *args: Any) -> str:
        return "".join(message["content"] or "" for message in messages)


@dataclass
class RecordingEngine(ScriptedEngine):
    """The scripted engine that remembers each request; with ``gate`` it stops after one token until it is set."""

    requests: list[GenerationRequest] = field(default_factory=list)
    gate: asyncio.Event | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        self.requests.append(request)
        self.started.set()
        count = 0
        async for event in super().stream(request):
            if isinstance(event, GeneratedToken) and event.token_id == 0:
                yield GeneratedToken(0, True)  # "<" ends the answer, as an EOS does
                return
            yield event
            count += 1
            if self.gate is not None and count == 1:
                await self.gate.wait()


def make_client(engine: ScriptedEngine, origins: tuple[str, ...] = ()) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig(engine.model_name), allowed_origins=origins)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


def engine(script: str = "hello world<", **kwargs: Any) -> RecordingEngine:
    """``<`` is the end-of-sequence token: the answer ends by itself (``completed``)."""
    return RecordingEngine(script=script, codec=TemplateCodec(), context_length=200, **kwargs)


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "scripted", "input": "ab", **fields}


def refused(response: httpx.Response, code: str, param: str | None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error


# -- translation --------------------------------------------------------------------------------------------------


def test_items_instructions_and_history_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "rules"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x":1}'},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
            "max_output_tokens": 7,
            "temperature": 0.5,
        }
    )
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "earlier"}]
    fields, turn = chat_fields(body, history)
    assert fields["messages"][0] == {"role": "system", "content": "be brief"}
    assert fields["messages"][1:3] == history
    assert turn == fields["messages"][3:]
    assert turn[0] == {"role": "system", "content": "rules"}
    assert turn[1] == {"role": "user", "content": "hi"}
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    assert turn[2] == {"role": "assistant", "content": "let me look", "tool_calls": calls}  # parallel calls: one
    assert turn[3] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert fields["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    ]
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert fields["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert (fields["max_completion_tokens"], fields["temperature"]) == (7, 0.5)
    assert "instructions" not in json.dumps(turn)  # instructions are never carried to the next turn


def test_the_translation_validates_as_the_chat_paths_request() -> None:
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [call, {"type": "function_call_output", "call_id": "c", "output": "1"}],
            "tools": [{"type": "function", "name": "f", "parameters": {}}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
    )
    chat = chat_request(body, []).chat
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert chat.messages[0].tool_calls is not None and chat.messages[0].tool_calls[0].id == "c"
    assert chat.messages[1].tool_call_id == "c"
    bad = ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": [{"type": "function", "name": "a b"}]})
    with pytest.raises(InvalidRequest) as info:
        chat_request(bad, [])  # the chat path's own rule on function names
    assert info.value.param == "tools"


# -- event assembly -----------------------------------------------------------------------------------------------


def test_writer_events_text_then_function_call_in_order_with_sequence_numbers() -> None:
    writer = ResponseWriter(ResponseObject(id="resp_1", model="m"))
    events = writer.started() + writer.text("he") + writer.text("llo")
    events += writer.function_call("f", "call_1") + writer.arguments('{"a"') + writer.arguments(":1}")
    events += writer.finish("stop", ResponseUsage.of(3, 4, 1))
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[6]["text"] == "hello" and events[12]["arguments"] == '{"a":1}'
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "hello"
    assert final["output"][1] == {
        "type": "function_call",
        "id": events[9]["item"]["id"],
        "call_id": "call_1",
        "name": "f",
        "arguments": '{"a":1}',
        "status": "completed",
    }
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 1} and final["usage"]["total_tokens"] == 7


def test_writer_length_is_incomplete_and_an_empty_answer_is_still_a_message() -> None:
    writer = ResponseWriter(ResponseObject(id="resp_1", model="m"))
    events = writer.finish("length", ResponseUsage.of(1, 0, 0))
    assert [event["type"] for event in events][-1] == "response.incomplete"
    response = events[-1]["response"]
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["content"][0]["text"] == "" and response["output"][0]["status"] == "incomplete"
    failed = ResponseWriter(ResponseObject(id="resp_2", model="m"))
    failed.text("x")
    kinds = [event["type"] for event in failed.failed("swarm_unavailable", "gone")]
    assert kinds == ["error", "response.failed"] and failed.response.error is not None


# -- over HTTP ------------------------------------------------------------------------------------------------------


async def test_create_store_get_and_delete() -> None:
    async with make_client(engine()) as client:
        created = await client.post("/v1/responses", json=request(instructions="x", metadata={"k": "v"}))
        assert created.status_code == 200, created.text
        body = created.json()
        assert body["id"].startswith("resp_") and created.headers["X-Session-Id"] == body["id"]
        assert body["object"] == "response" and body["status"] == "completed"
        assert body["output"][0]["content"][0]["text"] == "hello world"
        assert body["usage"]["input_tokens"] == 3 and body["usage"]["output_tokens"] == 12  # "x" + "ab"; EOS counts
        assert (body["instructions"], body["metadata"]) == ("x", {"k": "v"})
        fetched = await client.get(f"/v1/responses/{body['id']}")
        assert fetched.status_code == 200 and fetched.json() == body
        deleted = await client.delete(f"/v1/responses/{body['id']}")
        assert deleted.json() == {"id": body["id"], "object": "response", "deleted": True}
        assert (await client.get(f"/v1/responses/{body['id']}")).status_code == 404
        unstored = (await client.post("/v1/responses", json=request(store=False))).json()
        assert unstored["store"] is False
        missing = await client.get(f"/v1/responses/{unstored['id']}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"


async def test_stream_events_add_up_to_the_stored_response() -> None:
    async with make_client(engine()) as client:
        streamed = await client.post("/v1/responses", json=request(stream=True))
        assert streamed.status_code == 200
        data = sse_data(streamed)
        assert data[-1] == "[DONE]"
        events = [json.loads(item) for item in data[:-1]]
        kinds = [event["type"] for event in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [event["sequence_number"] for event in events] == list(range(len(events)))
        text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
        assert text == "hello world"
        final = events[-1]["response"]
        stored = (await client.get(f"/v1/responses/{final['id']}")).json()
        assert stored == final and stored["output"][0]["content"][0]["text"] == text


async def test_previous_response_id_prepends_the_stored_conversation_without_its_instructions() -> None:
    scripted = engine(script="yes<")
    async with make_client(scripted) as client:
        first = (await client.post("/v1/responses", json=request(input="ab", instructions="zz"))).json()
        second = await client.post("/v1/responses", json=request(input="cd", previous_response_id=first["id"]))
        assert second.status_code == 200, second.text
        assert second.json()["previous_response_id"] == first["id"]
        codec = scripted.codec
        assert [codec.decode(r.prompt_ids) for r in scripted.requests] == ["zzab", "abyescd"]
        third = await client.post("/v1/responses", json=request(input="e", previous_response_id=second.json()["id"]))
        assert codec.decode(scripted.requests[-1].prompt_ids) == "abyescdyese"
        assert third.status_code == 200
        unknown = await client.post("/v1/responses", json=request(previous_response_id="resp_nope"))
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "previous_response_id"
        assert unknown.json()["error"]["code"] == "previous_response_not_found"


async def test_cancel_stops_a_running_response() -> None:
    gated = engine(gate=asyncio.Event())
    async with make_client(gated) as client:
        running = asyncio.create_task(client.post("/v1/responses", json=request()))
        async with asyncio.timeout(30):
            await gated.started.wait()  # the generation runs (and its response is stored in_progress)
            (session,) = (await client.get("/v1/sessions")).json()["data"]  # a response's session has its id
            response_id = session["id"]
            assert (await client.get(f"/v1/responses/{response_id}")).json()["status"] == "in_progress"
            cancelled = await client.post(f"/v1/responses/{response_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["status"] == "cancelled"
            answer = await running
        assert answer.status_code == 409
        assert (await client.get(f"/v1/responses/{response_id}")).json()["status"] == "cancelled"
        again = await client.post(f"/v1/responses/{response_id}/cancel")
        assert again.status_code == 400  # only a response in progress can be cancelled


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"include": ["file_search_call.results"]}, "unsupported_parameter", "include"),
        ({"truncation": "auto"}, "unsupported_parameter", "truncation"),
        ({"top_logprobs": 21}, None, "top_logprobs"),
        ({"tools": [{"type": "web_search"}]}, "unsupported_value", "tools"),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]}, None, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "unsupported_value", "input"),
        ({"input": []}, "invalid_value", "input"),
        ({"max_output_tokens": 500}, "context_length_exceeded", "input"),
    ],
)
async def test_refusals(fields: dict[str, Any], code: str | None, param: str) -> None:
    async with make_client(engine()) as client:
        response = await client.post("/v1/responses", json=request(**fields))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and (code is None or error["code"] == code), error


# -- CORS ---------------------------------------------------------------------------------------------------------


async def test_cors_preflight_only_for_allowed_origins() -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization,content-type"
    async with make_client(engine(), origins=("https://app.example",)) as client:
        allowed = await client.options("/v1/responses", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        other = await client.options("/v1/responses", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        simple = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert simple.headers["access-control-allow-origin"] == "https://app.example"
    async with make_client(engine()) as client:  # default: no CORS at all
        response = await client.options("/v1/responses", headers=preflight)
        assert "access-control-allow-origin" not in response.headers
        plain = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in plain.headers


# -- tools and formats through the chat path --------------------------------------------------------------------------


TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def test_a_tool_call_is_a_function_call_item_streamed_as_argument_deltas() -> None:
    scripted = AsciiEngine(CALL)
    async with make_client(scripted) as client:  # type: ignore[arg-type]
        body = request(input="weather?", tools=[TOOL])
        whole = (await client.post("/v1/responses", json=body)).json()
        (call,) = whole["output"]
        assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
        assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"]
        assert whole["status"] == "completed"
        streamed = await client.post("/v1/responses", json={**body, "stream": True})
        events = [json.loads(data) for data in sse_data(streamed)[:-1]]
        kinds = [event["type"] for event in events]
        assert "response.output_text.delta" not in kinds
        added = next(event for event in events if event["type"] == "response.output_item.added")
        assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert deltas == done["arguments"] == call["arguments"]
        assert kinds[-1] == "response.completed"
        # The tool's result goes back as a function_call_output item, continuing the stored conversation.
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        follow = {"model": "scripted", "input": [result], "previous_response_id": whole["id"], "tools": [TOOL]}
        assert (await client.post("/v1/responses", json=follow)).status_code == 200
        prompt = scripted.codec.decode(scripted.requests[-1].prompt_ids)
        assert prompt.index('"arguments": {"city": "Paris"}') < prompt.index("sunny")  # the call, then its result


async def test_text_format_json_schema_and_forced_tools_become_the_chat_paths_grammar() -> None:
    scripted = AsciiEngine('{"a": 1}')
    fmt = {"type": "json_schema", "name": "o", "schema": {"type": "object"}, "strict": True}
    async with make_client(scripted) as client:  # type: ignore[arg-type]
        response = await client.post("/v1/responses", json=request(text={"format": fmt}))
        assert response.json()["output"][0]["content"][0]["text"] == '{"a": 1}'
        forced = await client.post("/v1/responses", json=request(tools=[TOOL], tool_choice="required"))
        assert forced.status_code == 200
    plain_grammar, forced_grammar = (r.grammar for r in scripted.requests)
    assert plain_grammar is not None and '"type": "object"' in plain_grammar.source.replace('":"', '": "')
    assert forced_grammar is not None and "get_weather" in forced_grammar.source


async def test_fields_that_would_change_the_answer_are_refused_by_name() -> None:
    async with make_client(engine()) as client:
        response = await client.post("/v1/responses", json=request(modalities=["audio"]))
        refused(response, "unsupported_parameter", "modalities")
        harmless = request(service_tier="auto", prompt_cache_key="k", safety_identifier="s", stream_options={})
        assert (await client.post("/v1/responses", json=harmless)).status_code == 200


async def test_a_stream_that_fails_ends_with_error_and_response_failed_and_is_stored_failed() -> None:
    failing = engine(failure=NodeUnreachable("every node left"), fail_at=3)
    async with make_client(failing) as client:
        streamed = await client.post("/v1/responses", json=request(stream=True))
        data = sse_data(streamed)
        assert data[-1] == "[DONE]"
        events = [json.loads(item) for item in data[:-1]]
        kinds = [event.get("type") for event in events]
        assert kinds[-3:] == ["error", "response.failed", None]  # then the envelope the openai client raises
        assert events[-3]["code"] == "swarm_unavailable" and events[-1]["error"]["code"] == "swarm_unavailable"
        failed = events[-2]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "swarm_unavailable"
        assert (await client.get(f"/v1/responses/{failed['id']}")).json()["status"] == "failed"
