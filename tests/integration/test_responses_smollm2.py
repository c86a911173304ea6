"""/v1/responses end to end: SmolLM2-135M-Instruct (the bundled GGUF) on two real nodes, two `gateway serve` replicas
sharing a private redis-server, the official `openai` client.

What a response says equals what the chat path says for the same conversation (so the translation is right on a
real chat template), the stream's text deltas add up to the non-streamed text, the second turn of
``previous_response_id`` sees the first (and the nodes keep its cache), a response made on replica A is read and
cancelled from replica B, and CORS preflights are answered for the allowed origin only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm
from tests.helpers.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def replicas(smollm2_swarm: LocalSwarm, smollm2_gguf: Path, module_redis: RedisServer) -> Iterator[list[Gateway]]:
    try:
        shared = ["--redis-url", module_redis.url, "--conversation-keep-alive", "30", "--default-max-tokens", "64"]
        a = start_gateway(
            smollm2_swarm, smollm2_gguf, *shared, "--replica-id", "A", "--allowed-origins", ORIGIN, timeout=600
        )
        b = start_gateway(smollm2_swarm, smollm2_gguf, *shared, "--replica-id", "B", timeout=600)
        yield [a, b]
    finally:
        stop_gracefully(smollm2_swarm)


def chat_text(gateway: Gateway, messages: list[dict[str, Any]], max_tokens: int) -> str:
    result = gateway.openai().chat.completions.create(
        model=gateway.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
    )
    return result.choices[0].message.content or ""


def test_string_and_item_input_with_instructions_answer_as_the_chat_path(replicas: list[Gateway]) -> None:
    a, _ = replicas
    client = a.openai()
    plain = client.responses.create(model=a.model, input="Name three colours.", temperature=0, max_output_tokens=24)
    assert plain.id.startswith("resp_") and plain.object == "response"
    assert plain.status in ("completed", "incomplete") and plain.output[0].type == "message"
    assert plain.usage is not None and plain.usage.output_tokens > 0
    expected = chat_text(a, [{"role": "user", "content": "Name three colours."}], 24)
    assert plain.output_text == expected and expected

    items = client.responses.create(
        model=a.model,
        instructions="You answer in French.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
        temperature=0,
        max_output_tokens=24,
    )
    messages = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Say hello."}]
    assert items.output_text == chat_text(a, messages, 24)
    assert items.instructions == "You answer in French."


def test_stream_events_in_order_and_deltas_add_up_to_the_non_streamed_text(replicas: list[Gateway]) -> None:
    a, b = replicas
    kwargs: dict[str, Any] = {"model": a.model, "input": "Write a haiku about rain.", "temperature": 0}
    kwargs["max_output_tokens"] = 40
    expected = a.openai().responses.create(**kwargs).output_text
    events = list(a.openai().responses.create(**kwargs, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == expected
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == expected
    # Stored in Redis: the other replica answers GET with the same response.
    fetched = b.openai().responses.retrieve(final.id)
    assert fetched.output_text == expected and fetched.status == final.status


def test_message_logprobs_are_the_chat_paths_streamed_and_not(replicas: list[Gateway]) -> None:
    """``include: ["message.output_text.logprobs"]``: the same tokens, logprobs and alternatives as chat's
    ``logprobs`` for the same conversation, on the output_text part and on the stream's deltas."""
    a, _ = replicas
    client = a.openai()
    asked: dict[str, Any] = {"model": a.model, "temperature": 0, "top_logprobs": 3}
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16, logprobs=True, **asked
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    expected = [(t.token, [top.token for top in t.top_logprobs]) for t in chat.choices[0].logprobs.content]
    include: Any = ["message.output_text.logprobs"]
    response = client.responses.create(input="Name three colours.", max_output_tokens=16, include=include, **asked)
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.text == chat.choices[0].message.content and response.top_logprobs == 3
    assert [(t.token, [top.token for top in t.top_logprobs]) for t in part.logprobs or []] == expected
    chosen = [t.logprob for t in chat.choices[0].logprobs.content]
    assert [t.logprob for t in part.logprobs or []] == pytest.approx(chosen, abs=1e-3)
    streamed = client.responses.create(
        input="Name three colours.", max_output_tokens=16, include=include, stream=True, **asked
    )
    deltas = [lp.token for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert deltas == [token for token, _ in expected]


def test_previous_response_id_continues_the_conversation_and_reuses_the_node_caches(replicas: list[Gateway]) -> None:
    a, _ = replicas
    client = a.openai()
    first_input = "My name is Ada. Reply with one word: OK."
    first = client.responses.create(model=a.model, input=first_input, temperature=0, max_output_tokens=48)
    second = client.responses.create(
        model=a.model,
        input="What is my name?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=32,
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # The nodes still held the first turn: only the new tokens were prefilled.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    conversation = [
        {"role": "user", "content": first_input},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == chat_text(a, conversation, 32)


def test_a_streamed_response_on_a_is_cancelled_from_b(replicas: list[Gateway]) -> None:
    a, b = replicas
    body: dict[str, Any] = {"model": a.model, "input": "Count from 1 to 500, one number a line.", "temperature": 0}
    body["max_output_tokens"] = 600
    started = threading.Event()
    seen: list[str] = []
    failure: list[BaseException] = []

    def read() -> None:
        try:
            for event in a.openai().responses.create(**body, stream=True):
                seen.append(event.type)
                if event.type == "response.output_text.delta":
                    started.set()
        except openai.APIError as exc:
            failure.append(exc)
        finally:
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(300)
    response_id = None
    with a.http() as http:  # the response id is the session id; the newest running session is ours
        sessions = http.get("/v1/sessions").json()["data"]
        response_id = next(s["id"] for s in sessions if s["id"].startswith("resp_") and s["status"] == "running")
    cancelled = b.openai().responses.cancel(response_id)
    reader.join(120)
    assert not reader.is_alive()
    assert cancelled.status == "cancelled"
    assert "response.completed" not in seen and "response.incomplete" not in seen
    assert failure and "cancelled" in str(failure[0])  # the stream ends with the cancel's error event
    assert b.openai().responses.retrieve(response_id).status == "cancelled"


def test_cors_preflight_is_answered_for_the_allowed_origin_only(replicas: list[Gateway]) -> None:
    a, b = replicas
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    with a.http() as http:
        allowed = http.options("/v1/responses", headers=preflight)
        other = http.options("/v1/responses", headers={**preflight, "Origin": "http://elsewhere.example"})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in other.headers
    with b.http() as http:  # no --allowed-origins: no CORS headers at all
        assert "access-control-allow-origin" not in http.options("/v1/responses", headers=preflight).headers


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_a_forced_tool_call_is_a_function_call_whose_streamed_arguments_add_up(replicas: list[Gateway]) -> None:
    a, _ = replicas
    client = a.openai()
    kwargs: dict[str, Any] = {
        "model": a.model,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 64,
    }
    whole = client.responses.create(**kwargs)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)  # the grammar guarantees the schema
    events = list(client.responses.create(**kwargs, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == calls[0].arguments
    # The tool's result continues the conversation (stored) and the model answers in text.
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}
    answer = client.responses.create(
        model=a.model,
        input=[result],  # type: ignore[list-item]
        previous_response_id=whole.id,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        temperature=0,
        max_output_tokens=32,
    )
    assert answer.output[0].type == "message" and answer.output_text


def test_text_format_json_schema_gives_output_that_validates(replicas: list[Gateway]) -> None:
    a, _ = replicas
    schema = {
        "type": "object",
        # a bounded age: at temperature 1 the model may write digits until max_output_tokens cuts the JSON short
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for temperature in (0, 1):
        response = a.openai().responses.create(
            model=a.model,
            input="Invent a person.",
            text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
            temperature=temperature,
            max_output_tokens=120,
        )
        value = json.loads(response.output_text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and isinstance(value["name"], str)
