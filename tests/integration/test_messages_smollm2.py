"""/v1/messages end to end: SmolLM2-135M-Instruct (the bundled GGUF) on two real nodes and `gateway serve --auth keys`,
the official `anthropic` client.

A message's greedy text equals what the chat path says for the same conversation (so the translation is right on a
real chat template), the streams (``messages.stream`` and ``create(stream=True)``) add up to the message, stop reasons
name what ended the answer, a forced tool call's input validates against its schema and its result turn is
answered, count_tokens counts what a message is charged, and bad input and a bad key are the SDK's typed errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema_rs
import pytest

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "sk-messages-test"
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def gateway(smollm2_swarm: LocalSwarm, smollm2_gguf: Path) -> Iterator[Gateway]:
    try:
        yield start_gateway(smollm2_swarm, smollm2_gguf, "--auth", "keys", "--admin-key", KEY, timeout=600)
    finally:
        stop_gracefully(smollm2_swarm)


def client(gateway: Gateway, key: str = KEY) -> anthropic.Anthropic:
    http = httpx2.Client(trust_env=False, timeout=120)
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0, http_client=http)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if isinstance(block, anthropic.types.TextBlock))


def tool_uses(message: anthropic.types.Message) -> list[anthropic.types.ToolUseBlock]:
    return [block for block in message.content if isinstance(block, anthropic.types.ToolUseBlock)]


def error_type(error: anthropic.APIStatusError) -> str:
    body: Any = error.body
    return str(body["error"]["type"])


def ask(gateway: Gateway, **fields: Any) -> dict[str, Any]:
    # The SDK's 2.x signature has no sampling parameters any more (Anthropic's newest models refuse them); the API
    # takes them, and greedy decoding makes the answers comparable.
    return {"model": gateway.model, "max_tokens": 24, "extra_body": {"temperature": 0}, **fields}


def test_greedy_text_equals_the_chat_path_streamed_or_not(gateway: Gateway) -> None:
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    system = "You are a terse assistant."
    chat = gateway.openai(KEY).chat.completions.create(
        model=gateway.model,
        messages=[{"role": "system", "content": system}, *conversation],  # type: ignore[list-item]
        max_tokens=24,
        temperature=0,
    )
    expected, usage = chat.choices[0].message.content, chat.usage
    assert usage is not None
    api = client(gateway)
    message = api.messages.create(**ask(gateway, system=system, messages=conversation))
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == gateway.model
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message) == expected
    assert message.stop_reason == ("end_turn" if chat.choices[0].finish_reason == "stop" else "max_tokens")
    assert message.usage.output_tokens == usage.completion_tokens
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == usage.prompt_tokens

    with api.messages.stream(**ask(gateway, system=system, messages=conversation)) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == expected == text_of(final)
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens

    raw = api.messages.create(**ask(gateway, system=system, messages=conversation), stream=True)
    kinds = [event.type for event in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


def test_stop_sequences_and_max_tokens_end_the_answer_and_say_so(gateway: Gateway) -> None:
    api = client(gateway)
    prompt = [{"role": "user", "content": "Describe the sea in one sentence."}]
    whole = api.messages.create(**ask(gateway, messages=prompt, max_tokens=40))
    text = text_of(whole)
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]  # the third word the model writes: the answer ends where it first appears
    stopped = api.messages.create(**ask(gateway, messages=prompt, max_tokens=40, stop_sequences=[stop, "zzz"]))
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert text_of(stopped) == text[: text.index(stop)]
    cut = api.messages.create(**ask(gateway, messages=prompt, max_tokens=3))
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)


def test_a_forced_tool_call_validates_and_its_result_is_answered(gateway: Gateway) -> None:
    api = client(gateway)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    forced = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    called = api.messages.create(**ask(gateway, messages=[question], max_tokens=60, **forced))
    assert called.stop_reason == "tool_use"
    uses = tool_uses(called)
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema_rs.validate(WEATHER["input_schema"], uses[0].input)

    with api.messages.stream(**ask(gateway, messages=[question], max_tokens=60, **forced)) as stream:
        streamed = stream.get_final_message()
    assert [block.type for block in streamed.content] == ["tool_use"]
    assert [use.input for use in tool_uses(streamed)] == [uses[0].input]  # greedy: the same call

    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees and sunny"}
    turns = [question, {"role": "assistant", "content": called.content}, {"role": "user", "content": [result]}]
    answered = api.messages.create(**ask(gateway, max_tokens=40, messages=turns, tools=[WEATHER]))
    assert answered.stop_reason in ("end_turn", "max_tokens", "tool_use") and answered.content


def test_output_config_format_makes_the_text_json_of_the_schema(gateway: Gateway) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    prompt = [{"role": "user", "content": "Name a colour and a number."}]
    output = {"format": {"type": "json_schema", "schema": schema}}
    message = client(gateway).messages.create(**ask(gateway, max_tokens=60, messages=prompt, output_config=output))
    assert message.stop_reason == "end_turn"
    jsonschema_rs.validate(schema, json.loads(text_of(message)))


def test_count_tokens_counts_what_the_message_is_charged(gateway: Gateway) -> None:
    api = client(gateway)
    fields = {"system": "Be brief.", "messages": [{"role": "user", "content": "Say one word, a colour."}]}
    counted = api.messages.count_tokens(model=gateway.model, **fields)  # type: ignore[arg-type]
    message = api.messages.create(**ask(gateway, max_tokens=4, **fields))
    assert counted.input_tokens > 0
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_bad_input_and_a_bad_key_are_the_sdks_typed_errors(gateway: Gateway) -> None:
    api = client(gateway)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        api.messages.create(**ask(gateway, messages=hi, extra_body={"top_a": 3}))
    assert error_type(bad.value) == "invalid_request_error" and "top_a" in str(bad.value)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        api.messages.create(**ask(gateway, messages=[{"role": "user", "content": [image]}]))
    with pytest.raises(anthropic.NotFoundError):
        api.messages.create(**{**ask(gateway, messages=hi), "model": "claude-x"})
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client(gateway, "sk-wrong").messages.create(**ask(gateway, messages=hi))
    assert error_type(refused.value) == "authentication_error"
