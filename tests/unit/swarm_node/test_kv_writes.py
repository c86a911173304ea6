"""Every block of a span stores its keys and values at every prefill and decode position, for every family.

A layer handed the cache under a keyword it does not name (transformers renamed ``past_key_values=`` to ``cache=``
in 5.24) swallows it and writes nothing; the span must notice in the forward itself (``KVNotWritten``), never serve
the silent answer that follows.
"""

from __future__ import annotations

import pytest
import torch

from shared.errors import CacheApiMismatch, KVNotWritten
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.kv_cache import SessionKV
from swarm_node.layer_api import cache_keyword
from swarm_node.span import BlockSpan, build_span
from tests.tiny_models import GetTinyModel

PROMPT = 7
DECODE_STEPS = 3


def _span(tiny_model: GetTinyModel, variant: str) -> BlockSpan:
    source = resolve_model(str(tiny_model(variant).folder))
    config = load_config(source)
    return build_span(config, open_weights(source, config), 0, config.num_hidden_layers)


def _filled(kv: SessionKV) -> torch.Tensor:
    """[num_layers, max_length] True where both the key and the value of some head are nonzero."""
    return kv.keys.abs().amax(dim=(1, 3)).gt(0) & kv.values.abs().amax(dim=(1, 3)).gt(0)


def test_every_block_writes_kv_at_every_prefill_and_decode_position(
    tiny_model: GetTinyModel, tiny_variant: str
) -> None:
    span = _span(tiny_model, tiny_variant)
    blocks = range(span.start, span.end)
    kv = span.new_session_kv(blocks, PROMPT + DECODE_STEPS + 1)
    generator = torch.Generator().manual_seed(0)
    span(torch.randn(1, PROMPT, span.hidden_size, generator=generator), [kv], [0], blocks)
    assert _filled(kv)[:, :PROMPT].all(), f"prefill left positions unwritten:\n{_filled(kv).int()}"
    for position in range(PROMPT, PROMPT + DECODE_STEPS):
        span(torch.randn(1, 1, span.hidden_size, generator=generator), [kv], [position], blocks)
        assert _filled(kv)[:, : position + 1].all(), f"decode at {position} left blocks unwritten"
    assert not _filled(kv)[:, PROMPT + DECODE_STEPS :].any()  # and nothing beyond what was sent
    assert kv.length == PROMPT + DECODE_STEPS


@pytest.mark.parametrize("tiny_variant", ["llama", "falcon", "bloom"], indirect=True)
@pytest.mark.parametrize("new_tokens", [PROMPT, 1])
def test_a_cache_under_the_wrong_keyword_is_an_error_not_an_answer(
    tiny_model: GetTinyModel, tiny_variant: str, new_tokens: int
) -> None:
    span = _span(tiny_model, tiny_variant)
    span.cache_keyword = "swarmgate_unknown_cache"  # what a renamed keyword does: the layer's **kwargs swallow it
    blocks = range(span.start, span.end)
    kv = span.new_session_kv(blocks, 16)
    with pytest.raises(KVNotWritten, match="stored"):
        span(torch.randn(1, new_tokens, span.hidden_size), [kv], [0], blocks)
    assert kv.length == 0  # nothing committed


def test_a_layer_naming_no_cache_keyword_refuses_to_start() -> None:
    class OldLayer(torch.nn.Module):
        def forward(self, hidden: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return hidden

    assert cache_keyword(type("New", (OldLayer,), {"forward": lambda self, h, cache=None: h}), "standard") == "cache"
    with pytest.raises(CacheApiMismatch, match=r"transformers \d+\.\d+"):
        cache_keyword(OldLayer, "standard")
