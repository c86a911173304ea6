"""/v1/embeddings end to end: SmolLM2-135M-Instruct (the bundled GGUF) on two real nodes, `gateway serve`, the
official `openai` client; the reference is transformers' whole model on the same file.

An embedding is the normed final hidden state of the input's last token (``hidden_states[-1]``, which transformers
takes after the final norm), L2-normalized. Many inputs in one request equal the same inputs one by one, and go
through the nodes' prefill batcher together; no node holds a session or cache room once the call returns.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hivemind.p2p import P2P

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.node_info import wait_all_free
from tests.helpers.processes import LocalSwarm
from tests.helpers.prometheus import node_url, scrape, value
from tests.helpers.smollm2 import Reference, SmolLM2Nodes, load_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOLERANCE = 2e-4  # per component of a unit vector: float32 through two processes vs one forward


@pytest.fixture(scope="module")
def swarm(
    smollm2_swarm: LocalSwarm, smollm2_nodes: SmolLM2Nodes, smollm2_gguf: Path
) -> Iterator[tuple[Gateway, Reference, list[int]]]:
    """The gateway, the reference model and each node's metrics port."""
    try:
        yield start_gateway(smollm2_swarm, smollm2_gguf), load_reference(smollm2_gguf), smollm2_nodes.metrics_ports
    finally:
        stop_gracefully(smollm2_swarm)


def expected_vector(reference: Reference, token_ids: list[int]) -> torch.Tensor:
    model, _ = reference
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1]  # after the norm
    return torch.nn.functional.normalize(hidden[0, -1], dim=0)


def prefill_forwards(port: int) -> float:
    return value(scrape(node_url(port)), "swarmgate_node_step_latency_seconds_count", kind="prefill")


def test_embeddings_equal_the_whole_models_last_token_state(swarm: tuple[Gateway, Reference, list[int]]) -> None:
    gateway, reference, _ = swarm
    tokenizer = reference[1]
    client = gateway.openai()
    text = "The quick brown fox jumps over the lazy dog."
    result = client.embeddings.create(model=gateway.model, input=text, encoding_format="float")
    ids = tokenizer.encode(text)
    assert len(result.data) == 1 and result.data[0].index == 0 and result.data[0].object == "embedding"
    vector = torch.tensor(result.data[0].embedding)
    assert vector.shape == (576,)
    assert torch.allclose(vector, expected_vector(reference, ids), atol=TOLERANCE)
    assert abs(float(vector.norm()) - 1.0) < 1e-5
    assert result.usage.prompt_tokens == len(ids) == result.usage.total_tokens
    assert result.model == gateway.model

    # Token ids give the same vector; base64 (the openai client's own default, decoded by it) the same floats.
    by_ids = client.embeddings.create(model=gateway.model, input=ids, encoding_format="float")
    assert by_ids.data[0].embedding == result.data[0].embedding
    default = client.embeddings.create(model=gateway.model, input=text)  # sent as base64, decoded by the client
    assert default.data[0].embedding == result.data[0].embedding
    raw = httpx.post(
        f"{gateway.url}/v1/embeddings",
        json={"model": gateway.model, "input": text, "encoding_format": "base64", "user": "someone"},
        trust_env=False,
        timeout=120,
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == result.data[0].embedding


async def test_a_batch_equals_its_inputs_one_by_one_shares_prefill_forwards_and_holds_no_cache(
    swarm: tuple[Gateway, Reference, list[int]], client_p2p: P2P, smollm2_nodes: SmolLM2Nodes
) -> None:
    gateway, reference, ports = swarm
    client = gateway.openai()
    texts = [f"Sentence number {i} is about {topic}." for i, topic in enumerate(["cats", "rain", "maths"] * 4)]
    singles = [client.embeddings.create(model=gateway.model, input=t, encoding_format="float") for t in texts]
    before = [prefill_forwards(port) for port in ports]
    batch = client.embeddings.create(model=gateway.model, input=texts, encoding_format="float")
    after = [prefill_forwards(port) for port in ports]
    assert [item.index for item in batch.data] == list(range(len(texts)))
    for single, item in zip(singles, batch.data, strict=True):
        assert torch.allclose(torch.tensor(item.embedding), torch.tensor(single.data[0].embedding), atol=TOLERANCE)
    tokens = [reference[1].encode(t) for t in texts]
    assert batch.usage.prompt_tokens == sum(len(ids) for ids in tokens)
    mixed = client.embeddings.create(model=gateway.model, input=[tokens[0], tokens[1]], encoding_format="float")
    assert torch.allclose(torch.tensor(mixed.data[1].embedding), expected_vector(reference, tokens[1]), atol=TOLERANCE)
    # The 12 prompts reached each node together: fewer padded forwards than inputs.
    assert all(0 < b - a < len(texts) for a, b in zip(before, after, strict=True)), (before, after)
    infos = await wait_all_free(client_p2p, smollm2_nodes.swarm, within=10)
    assert all(i.sessions == 0 and i.cache_tokens_left == i.cache_tokens_total for i in infos)


def test_bad_inputs_get_openai_errors(swarm: tuple[Gateway, Reference, list[int]]) -> None:
    gateway, _, _ = swarm
    client = gateway.openai()
    cases: list[tuple[dict[str, object], str | None]] = [
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], [10**9]]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": " hello" * 9000}, "input"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=gateway.model, **extra)  # type: ignore[arg-type]
        assert caught.value.status_code == 400
        assert isinstance(caught.value.body, dict) and caught.value.body.get("param") == param, caught.value.body
    same_width = client.embeddings.create(model=gateway.model, input="hi", dimensions=576, encoding_format="float")
    assert len(same_width.data[0].embedding) == 576
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
