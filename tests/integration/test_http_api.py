"""The OpenAI-compatible API of a real `gateway serve` over real node processes, driven by real clients.

One swarm per module: a DHT, two nodes (blocks 0:3 and 3:6) of a tiny random Llama with a word-level tokenizer
(tokens ``t0 … t127``, a chat template of its own), and the gateway subprocess. The transformers model with the
same weights is the reference. The node-killing test runs last.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
import torch
from hivemind.p2p import P2P
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tests.helpers.gateway import Gateway, kill_tree, start_gateway, stop_gracefully
from tests.helpers.node_info import wait_all_free, wait_each_holding
from tests.helpers.processes import LocalSwarm
from tests.integration.conftest import CONTEXT
from tests.tiny_models import TinyModel

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 3, 42, 8, 1]


@pytest.fixture(scope="module")
def tokenizer(chat_model: TinyModel) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(chat_model.folder)


@pytest.fixture(scope="module")
def gateway(module_swarm: LocalSwarm, chat_model: TinyModel) -> Iterator[Gateway]:
    """The gateway starts before any node: it must answer 503 until the blocks are covered."""
    try:
        module_swarm.start_dht()
        # The last test kills the sole node of 3:6: a short failover wait gets its error event without a long wait.
        args = ("--step-timeout", "10", "--failover-wait", "3")
        gateway = start_gateway(module_swarm, chat_model.folder, *args, wait_ready=False)
        with gateway.http() as client:
            # Ready (it answers, with 503 missing_blocks itself); the gap is in the body, and ?swarm=complete is 503.
            ready = client.get("/ready")
            assert ready.status_code == 200, ready.text
            assert ready.json()["swarm"]["complete"] is False and ready.json()["swarm"]["missing_blocks"] == "0:6"
            _assert_error(client.get("/ready", params={"swarm": "complete"}), 503, "missing_blocks")
            body = {"model": gateway.model, "prompt": "t1 t2", "max_tokens": 2}
            _assert_error(client.post("/v1/completions", json=body), 503, "missing_blocks")
        spans = ("0:3", "3:6")
        module_swarm.start_nodes(chat_model.folder, spans, "--cache-tokens", "8192")
        gateway.wait_ready()
        yield gateway
    finally:
        stop_gracefully(module_swarm)


def _assert_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


def greedy_ids(model: PreTrainedModel, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
    return [int(t) for t in out[0, len(prompt) :]]


def continuation(tokenizer: PreTrainedTokenizerBase, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``, as a client reads it."""
    return str(tokenizer.decode(prompt + new))[len(tokenizer.decode(prompt)) :]


def test_models_health_and_tokenizer_endpoints(gateway: Gateway) -> None:
    client = gateway.openai()
    models = client.models.list().data
    assert [m.id for m in models] == [gateway.model] == [client.models.retrieve(gateway.model).id]
    assert models[0].model_extra is not None and models[0].model_extra["context_length"] == CONTEXT
    with gateway.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/ready").status_code == 200
        tokens = http.post("/tokenize", json={"prompt": "t4 t5 t6"}).json()
        assert tokens == {"count": 3, "max_model_len": CONTEXT, "tokens": [4, 5, 6]}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "t9"}]}).json()
        assert chat["tokens"] == [1, 9, 2, 3]
        assert http.post("/detokenize", json={"tokens": [4, 5, 6]}).json() == {"prompt": "t4 t5 t6"}


def test_swarm_view_names_who_serves_each_block(gateway: Gateway, module_swarm: LocalSwarm) -> None:
    with gateway.http() as http:
        view = http.get("/v1/swarm").json()
    assert view["model"] == gateway.model and view["ready"] and view["missing_blocks"] == []
    assert [b["block"] for b in view["blocks"]] == list(range(6)) and all(b["live"] == 1 for b in view["blocks"])
    serving = {p.peer_id for p in module_swarm.processes if p.peer_id}
    nodes = {n["peer_id"]: n for n in view["nodes"]}
    assert set(nodes) == serving
    assert sorted((n["start"], n["end"]) for n in nodes.values()) == [(0, 3), (3, 6)]
    for node in nodes.values():
        assert node["state"] == "online" and node["throughput"] > 0 and node["cache_tokens_left"] > 0
        assert node["banned"] is False
        assert node["rtt"] is None or node["rtt"] >= 0


def test_greedy_completion_equals_transformers_streamed_or_not(
    gateway: Gateway, chat_model: TinyModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    expected_ids = greedy_ids(chat_model.model, PROMPT, 24)
    expected = continuation(tokenizer, PROMPT, expected_ids)
    client = gateway.openai()
    result = client.completions.create(model=gateway.model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    (choice,) = result.choices
    assert choice.text == expected and choice.finish_reason == "length"
    assert result.usage is not None and (result.usage.prompt_tokens, result.usage.completion_tokens) == (7, 24)

    # Logprobs are transformers' log-softmax at each position; offsets count from the start of the prompt.
    with torch.no_grad():
        logits = chat_model.model(torch.tensor([PROMPT + expected_ids])).logits[0]
    reference = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)  # [24, V]
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [f"t{t}" for t in expected_ids]
    want = reference.gather(-1, torch.tensor(expected_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), want, atol=1e-4, rtol=1e-4)
    for top, row in zip(choice.logprobs.top_logprobs or [], reference, strict=True):
        assert set(top) == {f"t{t}" for t in row.topk(3).indices.tolist()}
    prompt_text = str(tokenizer.decode(PROMPT))
    assert choice.logprobs.text_offset == [
        len(prompt_text) + len(continuation(tokenizer, PROMPT, expected_ids[:i])) for i in range(24)
    ]

    stream = client.completions.create(model=gateway.model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected


def test_echo_returns_prompt_logprobs(gateway: Gateway, chat_model: TinyModel) -> None:
    client = gateway.openai()
    result = client.completions.create(
        model=gateway.model, prompt=" ".join(f"t{t}" for t in PROMPT), max_tokens=0, echo=True, logprobs=1
    )
    (choice,) = result.choices
    assert choice.text == "t5 t17 t99 t3 t42 t8 t1" and choice.logprobs is not None
    assert choice.logprobs.tokens == [f"t{t}" for t in PROMPT]
    assert choice.logprobs.token_logprobs is not None and choice.logprobs.token_logprobs[0] is None
    with torch.no_grad():
        logits = chat_model.model(torch.tensor([PROMPT])).logits[0]
    want = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs[1:]), want, atol=1e-4, rtol=1e-4)
    # Each token's text includes the space before it (word-level decoding joins with spaces).
    assert choice.logprobs.text_offset == [0, 2, 6, 10, 13, 17, 20]


def test_chat_greedy_equals_transformers_with_logprobs(
    gateway: Gateway, chat_model: TinyModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    messages = [{"role": "system", "content": "t20 t21"}, {"role": "user", "content": "t7 t8 t9"}]
    prompt = [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]]
    expected = continuation(tokenizer, prompt, greedy_ids(chat_model.model, prompt, 16))
    client = gateway.openai()
    result = client.chat.completions.create(
        model=gateway.model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    (choice,) = result.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length" and result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt), 16)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == 16
    for entry in choice.logprobs.content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


def test_chat_n2_seeded_streamed_equals_not_streamed_with_usage(gateway: Gateway) -> None:
    client = gateway.openai()
    kwargs = {"model": gateway.model, "messages": [{"role": "user", "content": "t7 t8"}], "max_tokens": 12}
    kwargs |= {"n": 2, "seed": 11, "temperature": 1.0}
    first = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    again = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1] and len(texts) == 2
    assert texts == [c.message.content for c in again.choices]  # same seed, same output
    assert first.usage is not None and first.usage.completion_tokens == 24

    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    chunks = list(stream)
    streamed = ["", ""]
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24 and all(chunk.usage is None for chunk in chunks[:-1])
    finals = [c for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(c.index for c in finals) == [0, 1] and {c.finish_reason for c in finals} == {"length"}


def test_completions_n2_best_of_and_seed(gateway: Gateway) -> None:
    client = gateway.openai()
    kwargs = {"model": gateway.model, "prompt": ["t1 t2", "t3 t4"], "max_tokens": 8, "n": 2, "seed": 3}
    first = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in client.completions.create(**kwargs).choices]  # type: ignore[call-overload]
    best = client.completions.create(**kwargs, best_of=3, logprobs=0)  # type: ignore[call-overload]
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    for pair in (best.choices[:2], best.choices[2:]):  # each prompt's two best, best first
        means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in pair]
        assert means[0] >= means[1]


def test_stop_string_spanning_tokens_is_found_and_not_returned(
    gateway: Gateway, chat_model: TinyModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    full = continuation(tokenizer, PROMPT, greedy_ids(chat_model.model, PROMPT, 24))
    words = full.split()
    stop = f"{words[5][1:]} {words[6][:2]}"  # the end of one token, a space, the start of the next
    expected = full[: full.index(stop)]
    client = gateway.openai()
    kwargs = {"model": gateway.model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": [stop, "t999"]}
    result = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert result.choices[0].text == expected and result.choices[0].finish_reason == "stop"
    assert result.usage is not None and result.usage.completion_tokens < 24  # generation ended at the stop
    chunks = list(client.completions.create(**kwargs, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def _sse_data(response: httpx.Response) -> list[str]:
    lines = list(response.iter_lines())
    # Besides data lines: event ids (numbered from 1, for Last-Event-ID), a retry hint, blank separators, pings.
    assert all(line == "" or line.startswith((":", "data: ", "id: ", "retry: ")) for line in lines), lines
    ids = [int(line.removeprefix("id: ")) for line in lines if line.startswith("id: ")]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert ids == list(range(1, len(data) + 1))
    return data


def test_raw_sse_chunks_have_one_id_the_session_header_and_done(gateway: Gateway) -> None:
    body = {"model": gateway.model, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 5}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    with gateway.http() as client, client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        session_id = response.headers["x-session-id"]
        data = _sse_data(response)
    assert data[-1] == "[DONE]" and session_id.startswith("chatcmpl-")
    chunks = [json.loads(item) for item in data[:-1]]
    assert {chunk["id"] for chunk in chunks} == {session_id}
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-2]] == [None] * (len(chunks) - 2)
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5

    with gateway.http() as client:
        response = client.post("/v1/completions", json={"model": gateway.model, "prompt": "t1", "max_tokens": 2})
    assert response.headers["x-session-id"] == response.json()["id"] != ""


ERROR_CASES = [
    ({"prompt": "t1", "temperature": 3}, 400, "invalid_value", "temperature"),
    ({"prompt": "t1", "n": 0}, 400, "invalid_value", "n"),
    ({"prompt": "t1", "max_tokens": "many"}, 400, "invalid_type", "max_tokens"),
    ({}, 400, "missing_required_parameter", "prompt"),
    ({"prompt": []}, 400, "invalid_value", "prompt"),
    ({"prompt": [1, 999]}, 400, "invalid_value", "prompt"),
    ({"prompt": "t1", "logit_bias": {"x": 1}}, 400, "invalid_value", "logit_bias"),
    ({"prompt": "t1", "logit_bias": {"3": 101}}, 400, "invalid_value", "logit_bias.3"),
    ({"prompt": "t1", "n": 2, "best_of": 1}, 400, "invalid_value", "best_of"),
    ({"prompt": "t1", "best_of": 2, "stream": True}, 400, "invalid_value", "best_of"),
    ({"prompt": "t1", "suffix": "t2"}, 400, "unsupported_value", "suffix"),
    ({"prompt": "t1", "max_tokens": CONTEXT}, 400, "context_length_exceeded", "max_tokens"),
    ({"prompt": "t1", "model": "gpt-4"}, 404, "model_not_found", "model"),
]


@pytest.mark.parametrize(("body", "status", "code", "param"), ERROR_CASES)
def test_completion_errors_use_openai_envelope(
    gateway: Gateway, body: dict[str, object], status: int, code: str, param: str
) -> None:
    with gateway.http() as client:
        _assert_error(client.post("/v1/completions", json={"model": gateway.model, **body}), status, code, param)


def test_other_errors_use_openai_envelope(gateway: Gateway) -> None:
    chat = {"model": gateway.model, "messages": [{"role": "user", "content": "t1"}]}
    with gateway.http() as client:
        headers = {"content-type": "application/json"}
        _assert_error(client.post("/v1/chat/completions", content=b"{not json", headers=headers), 400, "invalid_json")
        _assert_error(client.post("/v1/chat/completions", json={**chat, "messages": []}), 400, "invalid_value")
        _assert_error(
            client.post("/v1/chat/completions", json={**chat, "max_tokens": CONTEXT}), 400, "context_length_exceeded"
        )
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        _assert_error(client.post("/v1/chat/completions", json={**chat, "messages": image}), 400, "unsupported_value")
        _assert_error(client.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400, "invalid_value")
        _assert_error(client.post("/v1/chat/completions", json={**chat, "model": "x"}), 404, "model_not_found")
        _assert_error(client.get("/v1/models/x"), 404, "model_not_found")
        _assert_error(client.get("/v1/nothing-here"), 404, "not_found")
        _assert_error(client.get("/v1/completions"), 405, "method_not_allowed")
    # The openai client raises its typed errors from the envelope.
    with pytest.raises(Exception) as raised:
        gateway.openai().completions.create(model="nope", prompt="t1")
    assert type(raised.value).__name__ == "NotFoundError"


async def test_eight_concurrent_streams_are_each_correct(
    gateway: Gateway, chat_model: TinyModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = [[i + 1, 2 * i + 3, 7 * i + 5] for i in range(8)]
    with torch.no_grad():  # one batched reference run: the prompts have the same length
        out = chat_model.model.generate(torch.tensor(prompts), max_new_tokens=16, do_sample=False)
    expected = [continuation(tokenizer, p, [int(t) for t in row[3:]]) for p, row in zip(prompts, out, strict=True)]
    client = gateway.async_openai()

    async def one(prompt: list[int]) -> str:
        stream = await client.completions.create(
            model=gateway.model, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    assert await asyncio.gather(*(one(p) for p in prompts)) == expected
    await client.close()


async def test_client_disconnect_cancels_generation_and_frees_node_caches(
    gateway: Gateway, module_swarm: LocalSwarm, client_p2p: P2P
) -> None:
    infos = await wait_all_free(client_p2p, module_swarm)
    assert len(infos) == 2 and all(i.cache_tokens_left == i.cache_tokens_total == 8192 for i in infos)
    body = {"model": gateway.model, "prompt": [1, 2, 3], "max_tokens": CONTEXT - 3, "temperature": 0}
    async with gateway.async_http() as client:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            lines = response.aiter_lines()  # held: a dropped line iterator would close the connection at once
            async for line in lines:
                if line.startswith("data: "):
                    break
            infos = await wait_each_holding(client_p2p, module_swarm, 1)  # while the stream is open
            assert all(i.sessions == 1 for i in infos), ([i.sessions for i in infos], gateway.log_text()[-2000:])
        # The stream is closed mid-generation: every node must get its room back.
        assert all(
            i.cache_tokens_left == 8192 and i.sessions == 0 for i in await wait_all_free(client_p2p, module_swarm)
        )

        # The same for a request that is not streamed.
        pending = asyncio.create_task(client.post("/v1/completions", json=body))
        infos = await wait_each_holding(client_p2p, module_swarm, 1)
        assert all(i.sessions == 1 for i in infos), ([i.sessions for i in infos], gateway.log_text()[-2000:])
        pending.cancel()
        assert all(
            i.cache_tokens_left == 8192 and i.sessions == 0 for i in await wait_all_free(client_p2p, module_swarm)
        )
    for _ in range(50):
        if gateway.log_text().count("completions cancelled") >= 2:
            break
        await asyncio.sleep(0.1)
    assert gateway.log_text().count("completions cancelled") == 2, gateway.log_text()[-3000:]


def test_an_error_after_the_stream_started_is_a_final_sse_event(gateway: Gateway, module_swarm: LocalSwarm) -> None:
    """Runs last: it kills the node of blocks 3:6 while a stream is under way."""
    (node,) = [p for p in module_swarm.processes if p.name.startswith("node-3-6")]
    body = {"model": gateway.model, "prompt": [1, 2], "max_tokens": CONTEXT - 2, "stream": True, "temperature": 0}
    with gateway.http() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        kill_tree(node)
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["type"] == "service_unavailable" and error["code"] in {"swarm_unavailable", "missing_blocks"}
