"""SmolLM2-135M-Instruct (the bundled GGUF) behind `gateway serve`: greedy text through HTTP equals transformers.

Two nodes (0:15, 15:30) and the gateway are real processes; the `openai` client talks to the gateway; the
reference is transformers' own ``generate`` on the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from gateway.api.detokenizer import IncrementalDetokenizer
from gateway.tokens import HFTokenCodec
from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

Reference = tuple[PreTrainedModel, PreTrainedTokenizerBase]


@pytest.fixture(scope="module")
def swarm_and_reference(module_swarm: LocalSwarm, smollm2_gguf: Path) -> Iterator[tuple[Gateway, Reference]]:
    try:
        module_swarm.start_dht()
        nodes = [module_swarm.start_node(smollm2_gguf, span) for span in ("0:15", "15:30")]
        # The reference loads while the nodes do.
        model = AutoModelForCausalLM.from_pretrained(
            str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
        for node in nodes:
            module_swarm.wait_serving(node)
        yield start_gateway(module_swarm, smollm2_gguf), (model, tokenizer)
    finally:
        stop_gracefully(module_swarm)


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


def test_smollm2_byte_tokens_never_split_a_character(swarm_and_reference: tuple[Gateway, Reference]) -> None:
    tokenizer = swarm_and_reference[1][1]
    codec = HFTokenCodec(tokenizer, len(tokenizer))
    text = "héllo 日本語 🙂 — ñandú"
    ids = codec.encode(text)
    detokenizer = IncrementalDetokenizer(codec)
    deltas = [detokenizer.push(token) for token in ids]
    assert all("\ufffd" not in delta for delta in deltas) and "".join(deltas) == text
    assert b"".join(codec.token_bytes(token) for token in ids) == text.encode()
