"""SmolLM2-135M-Instruct (the bundled GGUF) behind `gateway serve`: greedy text through HTTP equals transformers.

Two nodes (0:15, 15:30) and the gateway are real processes; the `openai` client talks to the gateway; the
reference is transformers' own ``generate`` on the whole model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P

from gateway.model.tokens import HFTokenCodec
from gateway.text.detokenizer import IncrementalDetokenizer
from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.node_info import node_infos, wait_all_free
from tests.helpers.processes import LocalSwarm
from tests.helpers.smollm2 import Reference, SmolLM2Nodes, load_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def swarm_and_reference(smollm2_swarm: LocalSwarm, smollm2_gguf: Path) -> Iterator[tuple[Gateway, Reference]]:
    try:
        reference = load_reference(smollm2_gguf)
        # No speculation: the cache-reuse test counts the tokens the nodes process, and on a loaded machine the
        # loopback round trip can pass --speculative-min-rtt, so drafts (rejected ones too) would count as well.
        # No spot checks: their forwards are node work too, and a test here counts the nodes' work exactly.
        gateway = start_gateway(
            smollm2_swarm,
            smollm2_gguf,
            *("--conversation-keep-alive", "5", "--speculative", "off", "--verify-check-rate", "0"),
        )
        yield gateway, reference
    finally:
        stop_gracefully(smollm2_swarm)


def reference_ids(reference: Reference, prompt_ids: list[int], tokens: int) -> list[int]:
    model, _ = reference
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=tokens, do_sample=False)
    return [int(t) for t in out[0, len(prompt_ids) :]]


def test_greedy_completion_and_chat_equal_transformers(swarm_and_reference: tuple[Gateway, Reference]) -> None:
    gateway, reference = swarm_and_reference
    tokenizer = reference[1]
    client = gateway.openai()
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct.Q4_1"

    prompt = "The capital of France is"
    expected = tokenizer.decode(reference_ids(reference, tokenizer.encode(prompt), 24), skip_special_tokens=True)
    kwargs = {"model": gateway.model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    assert client.completions.create(**kwargs).choices[0].text == expected  # type: ignore[call-overload]
    streamed = client.completions.create(**kwargs, stream=True)  # type: ignore[call-overload]
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected

    messages = [{"role": "user", "content": "Name three colours."}]
    chat_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    ids = reference_ids(reference, [int(t) for t in chat_prompt], 48)
    ended = ids[-1] == tokenizer.eos_token_id
    chat = {"model": gateway.model, "messages": messages, "max_tokens": 48, "temperature": 0}
    result = client.chat.completions.create(**chat)  # type: ignore[call-overload]
    assert result.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)
    assert result.choices[0].finish_reason == ("stop" if ended else "length")
    assert result.usage.completion_tokens == len(ids)
    chunks = client.chat.completions.create(**chat, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == result.choices[0].message.content


def test_ignore_eos_generates_through_an_end_token_even_at_the_first_position(
    swarm_and_reference: tuple[Gateway, Reference],
) -> None:
    """Issue 16's case: this prompt as a completion makes SmolLM2 end at once; ignore_eos must not."""
    gateway, _ = swarm_and_reference
    prompt = "Write a long story about a lighthouse keeper."
    client = gateway.openai()
    kwargs = {"model": gateway.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "seed": 1}
    plain = client.completions.create(**kwargs)  # type: ignore[call-overload]
    ignored = client.completions.create(**kwargs, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    # Greedy, SmolLM2's first token here is <|im_end|> (transformers agrees): the end token at the first position.
    assert (plain.usage.completion_tokens, plain.choices[0].finish_reason, plain.choices[0].text) == (1, "stop", "")
    assert ignored.usage.completion_tokens == 8 and ignored.choices[0].finish_reason == "length"
    assert ignored.choices[0].text.strip()  # it went on past the end token and wrote something
    streamed = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ignored.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


async def test_eight_concurrent_greedy_streams_equal_transformers_token_for_token(
    swarm_and_reference: tuple[Gateway, Reference],
) -> None:
    """Batched on the nodes and in the gateway's LM head, each stream still gets exactly its own tokens."""
    gateway, reference = swarm_and_reference
    tokenizer = reference[1]
    prompts = [
        "The capital of France is",
        "Water boils at",
        "My favourite colour is",
        "def fibonacci(n):",
        "Once upon a time",
        "The three primary colours are",
        "In 1969, humans",
        "A haiku about the sea:",
    ]
    expected = [
        tokenizer.decode(reference_ids(reference, tokenizer.encode(p), 20), skip_special_tokens=True) for p in prompts
    ]
    client = gateway.async_openai()

    async def streamed(prompt: str) -> str:
        stream = await client.completions.create(
            model=gateway.model, prompt=prompt, max_tokens=20, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    assert await asyncio.gather(*(streamed(p) for p in prompts)) == expected
    await client.close()


def test_smollm2_byte_tokens_never_split_a_character(swarm_and_reference: tuple[Gateway, Reference]) -> None:
    tokenizer = swarm_and_reference[1][1]
    codec = HFTokenCodec(tokenizer, len(tokenizer))
    text = "héllo 日本語 🙂 — ñandú"
    ids = codec.encode(text)
    detokenizer = IncrementalDetokenizer(codec)
    deltas = [detokenizer.push(token) for token in ids]
    assert all("\ufffd" not in delta for delta in deltas) and "".join(deltas) == text
    assert b"".join(codec.token_bytes(token) for token in ids) == text.encode()


async def test_a_second_chat_turn_reuses_the_first_turns_node_caches(
    swarm_and_reference: tuple[Gateway, Reference], smollm2_nodes: SmolLM2Nodes, client_p2p: P2P
) -> None:
    gateway, reference = swarm_and_reference
    client = gateway.async_openai()
    chat = {"model": gateway.model, "max_tokens": 32, "temperature": 0}

    async def processed() -> list[int]:
        return [info.tokens_processed for info in await node_infos(client_p2p, smollm2_nodes.swarm)]

    free = await wait_all_free(client_p2p, smollm2_nodes.swarm, within=30)
    assert all(i.sessions == 0 for i in free)  # others expired
    turn1 = [{"role": "user", "content": "What is the capital of France?"}]
    first = await client.chat.completions.create(messages=turn1, **chat)  # type: ignore[call-overload]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the capital of Italy?"},
    ]
    before = await processed()
    second = await client.chat.completions.create(messages=turn2, **chat)  # type: ignore[call-overload]
    reused = [b - a for a, b in zip(before, await processed(), strict=True)]
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The re-rendered reply tokenizes as it was generated: the whole first turn is reused, not just its prompt.
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2, (cached, first.usage)

    # Turn 3, streamed, at once (the kept conversation lives 5 s: the reference check of turn 2 comes after it): the
    # usage chunk says the same.
    turn3 = [
        *turn2,
        {"role": "assistant", "content": second.choices[0].message.content},
        {"role": "user", "content": "Thanks!"},
    ]
    stream = await client.chat.completions.create(  # type: ignore[call-overload]
        messages=turn3, stream=True, stream_options={"include_usage": True}, **chat
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens
    ids = reference[1].apply_chat_template(turn2, add_generation_prompt=True)["input_ids"]
    expected = reference_ids(reference, [int(t) for t in ids], 32)
    assert second.choices[0].message.content == reference[1].decode(expected, skip_special_tokens=True)

    # Kept conversations expire (keep-alive 5 s): every node gets its room back.
    infos = await wait_all_free(client_p2p, smollm2_nodes.swarm, within=60)
    assert all(i.sessions == 0 and i.cache_tokens_left == i.cache_tokens_total for i in infos), infos

    # The same turn 2 from scratch: the same text, the whole conversation sent to the nodes again.
    before = await processed()
    fresh = await client.chat.completions.create(messages=turn2, **chat)  # type: ignore[call-overload]
    full = [b - a for a, b in zip(before, await processed(), strict=True)]
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].message.content == second.choices[0].message.content
    assert fresh.usage.completion_tokens == second.usage.completion_tokens
    assert [f - r for f, r in zip(full, reused, strict=True)] == [cached] * 2, (full, reused)
    await client.close()
