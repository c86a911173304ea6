"""The gateway's head applies each family's own parts: Gemma's embedding scale and logit soft-capping, BLOOM's
embedding LayerNorm, LayerNorm final norms with biases (Falcon, BLOOM). Logits equal transformers' own."""

from __future__ import annotations

import torch

from gateway.model.head import build_head
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.span import build_span
from tests.tiny_models import VOCAB, GetTinyModel


def test_logits_through_head_and_span_equal_transformers(tiny_model: GetTinyModel, tiny_variant: str) -> None:
    tiny = tiny_model(tiny_variant)
    source = resolve_model(str(tiny.folder))
    config = load_config(source)
    reader = open_weights(source, config)
    head, span = build_head(config, reader), build_span(config, reader, 0, config.num_hidden_layers)
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(7))
    blocks = range(0, config.num_hidden_layers)
    logits = head.logits(span(head.embed(ids), [span.new_session_kv(blocks, 11)], [0], blocks))
    with torch.inference_mode():
        expected = tiny.model(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_gemma2_soft_caps_the_logits(tiny_model: GetTinyModel) -> None:
    """The cap bends these logits measurably, so the equality above would fail without it."""
    tiny = tiny_model("gemma2")
    source = resolve_model(str(tiny.folder))
    config = load_config(source)
    head = build_head(config, open_weights(source, config))
    cap = config.final_logit_softcapping
    assert head.logit_softcap == cap and head.embed_scale is not None
    hidden = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    raw = head.scorer(head.norm(hidden))
    logits = head.logits(hidden)
    torch.testing.assert_close(logits, torch.tanh(raw / cap) * cap)
    assert float((logits - raw).abs().max()) > 0.1 and float(logits.abs().max()) < cap
