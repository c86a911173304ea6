"""Ollama's API end to end: SmolLM2-135M-Instruct (the bundled GGUF) on two real nodes, `gateway serve`, the official
`ollama` Python client on /api.

Greedy text equals the chat endpoint's for the same messages (so the translation is right on a real template), a
stream adds up to the non-streamed answer and ends with ``done`` and measured timings, embeddings equal
/v1/embeddings', a tool call comes back with its arguments as an object, ``format`` (a JSON schema) is obeyed, and an
unknown model is Ollama's 404.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import ollama
import pytest

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MESSAGES = [{"role": "user", "content": "Name three colours."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def gateway(smollm2_swarm: LocalSwarm, smollm2_gguf: Path) -> Iterator[Gateway]:
    try:
        yield start_gateway(smollm2_swarm, smollm2_gguf, timeout=600)
    finally:
        stop_gracefully(smollm2_swarm)


def client(gateway: Gateway) -> ollama.Client:
    return ollama.Client(host=gateway.url, trust_env=False, timeout=120)


def chat_completion(gateway: Gateway, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    return gateway.openai().chat.completions.create(
        model=gateway.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
    )


def test_chat_streamed_and_not_equals_the_chat_endpoint(gateway: Gateway) -> None:
    expected = chat_completion(gateway, MESSAGES, 32)
    options = {"temperature": 0, "num_predict": 32}
    tagged = f"{gateway.model}:latest"
    answer = client(gateway).chat(model=tagged, messages=MESSAGES, options=options, stream=False)
    assert answer.message.role == "assistant"
    assert answer.message.content == expected.choices[0].message.content
    assert answer.done and answer.done_reason == ("length" if expected.choices[0].finish_reason == "length" else "stop")
    assert answer.model == tagged
    assert answer.prompt_eval_count == expected.usage.prompt_tokens
    assert answer.eval_count == expected.usage.completion_tokens
    assert answer.total_duration and answer.prompt_eval_duration and answer.eval_duration
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration

    parts = list(client(gateway).chat(model=gateway.model, messages=MESSAGES, options=options, stream=True))
    assert len(parts) > 2 and [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts) == answer.message.content
    assert parts[-1].eval_count == answer.eval_count and parts[-1].done_reason == answer.done_reason

    # Without "stream" the HTTP API streams (Ollama's default; its Python client sends stream: false itself).
    body = {"model": gateway.model, "messages": MESSAGES, "options": options}
    with httpx.stream("POST", f"{gateway.url}/api/chat", json=body, trust_env=False, timeout=120) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines()]
    assert "".join(line["message"]["content"] for line in lines) == answer.message.content and lines[-1]["done"]


def test_generate_with_the_template_and_raw(gateway: Gateway) -> None:
    expected = chat_completion(gateway, MESSAGES, 24).choices[0].message.content
    options = {"temperature": 0, "num_predict": 24}
    templated = client(gateway).generate(model=gateway.model, prompt=MESSAGES[0]["content"], options=options)
    assert templated.response == expected and templated.done and templated.context

    prompt = "The capital of France is"
    completion = gateway.openai().completions.create(model=gateway.model, prompt=prompt, max_tokens=12, temperature=0)
    raw = client(gateway).generate(
        model=gateway.model, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 12}
    )
    assert raw.response == completion.choices[0].text
    streamed = client(gateway).generate(
        model=gateway.model, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 12}, stream=True
    )
    assert "".join(part.response or "" for part in streamed) == raw.response


def test_embed_equals_v1_embeddings(gateway: Gateway) -> None:
    texts = ["A cat sat on the mat.", "Rain is falling."]
    ours = gateway.openai().embeddings.create(model=gateway.model, input=texts, encoding_format="float")
    result = client(gateway).embed(model=f"{gateway.model}:latest", input=texts)
    assert [list(vector) for vector in result.embeddings] == [item.embedding for item in ours.data]
    assert result.prompt_eval_count == ours.usage.prompt_tokens
    legacy = client(gateway).embeddings(model=gateway.model, prompt=texts[1])
    assert list(legacy.embedding) == ours.data[1].embedding


def test_tags_show_ps_and_version(gateway: Gateway) -> None:
    tagged = f"{gateway.model}:latest"
    listed = client(gateway).list()
    assert [m.model for m in listed.models] == [tagged]
    model = listed.models[0]
    assert model.details is not None and model.details.family == "llama" and model.details.format == "gguf"
    assert model.details.quantization_level == "Q4_1" and model.details.parameter_size == "135M"
    assert model.size and model.size > 50_000_000
    shown = client(gateway).show(tagged)
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.modelinfo is not None and shown.modelinfo["llama.context_length"] > 0
    assert shown.template and "im_start" in shown.template
    running = client(gateway).ps()
    assert [m.model for m in running.models] == [tagged] and running.models[0].context_length
    version = httpx.get(f"{gateway.url}/api/version", trust_env=False, timeout=30).json()
    assert version["version"].count(".") == 2


def test_tools_and_an_earlier_call_with_its_result_reach_the_template_as_the_chat_endpoints(gateway: Gateway) -> None:
    """SmolLM2-135M does not call tools unforced, and Ollama's API cannot force a call: the output side (a call's
    arguments as an object) is pinned with the official client in tests/unit/gateway/api/serving/test_ollama.py.
    Here: tools, an assistant's call (arguments as an object) and a tool result give the chat endpoint's answer."""
    ollama_messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "Sunny, 21 degrees.", "tool_name": "get_weather"},
    ]
    openai_messages: list[dict[str, Any]] = [
        ollama_messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "Sunny, 21 degrees.", "name": "get_weather"},
    ]
    expected = gateway.openai().chat.completions.create(
        model=gateway.model,
        messages=openai_messages,  # type: ignore[arg-type]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        max_tokens=24,
        temperature=0,
    )
    answer = client(gateway).chat(
        model=gateway.model,
        messages=ollama_messages,
        tools=[WEATHER_TOOL],
        options={"temperature": 0, "num_predict": 24},
        stream=False,
    )
    assert answer.message.content == (expected.choices[0].message.content or "")
    assert answer.done and answer.eval_count == expected.usage.completion_tokens


def test_format_schema_output_validates(gateway: Gateway) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    answer = client(gateway).chat(
        model=gateway.model,
        messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
        format=schema,
        options={"temperature": 0, "num_predict": 128},
        stream=False,
    )
    jsonschema_rs.validate(schema, json.loads(answer.message.content or ""))
    as_json = client(gateway).generate(
        model=gateway.model,
        prompt='Give a JSON object with a key "ok" set to true.',
        format="json",
        options={"temperature": 0, "num_predict": 128},
    )
    assert isinstance(json.loads(as_json.response), dict)


def test_an_unknown_model_and_a_bad_option_are_ollama_errors(gateway: Gateway) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        client(gateway).chat(model="no-such-model", messages=MESSAGES, stream=False)
    assert caught.value.status_code == 404 and "not found" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client(gateway).chat(model=gateway.model, messages=MESSAGES, options={"mirostat": 1}, stream=False)
    assert caught.value.status_code == 400 and "mirostat" in caught.value.error
