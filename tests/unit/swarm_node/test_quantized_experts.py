"""The per-expert module that quantized MoE blocks use computes what transformers' fused experts compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.quantized_experts import QuantizedExperts, replace_experts
from swarm_node.span import build_span
from tests.tiny_models import GetTinyModel


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_per_expert_linears_equal_the_fused_experts(tiny_model: GetTinyModel, variant: str) -> None:
    """With plain linear layers in place of quantized ones, a batch of 5 rows gives the fused module's output."""
    source = resolve_model(str(tiny_model(variant).folder))
    config = load_config(source)
    fused = build_span(config, open_weights(source, config), 0, 2)
    split = build_span(config, open_weights(source, config), 0, 2)
    for block in split.layers.values():
        replace_experts(block, lambda linear: linear)
    assert all(isinstance(block.mlp.experts, QuantizedExperts) for block in split.layers.values())
    assert not any(param.dim() == 3 for param in split.parameters())
    hidden = torch.randn(5, 1, config.hidden_size, generator=torch.Generator().manual_seed(2))
    outputs = []
    for span in (fused, split):
        sessions = [span.new_session_kv(range(0, 2), 4) for _ in range(5)]
        outputs.append(span(hidden, sessions, [0] * 5, range(0, 2)))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=0)


def test_experts_with_biases_are_refused() -> None:
    experts = nn.Module()
    experts.has_bias = True
    with pytest.raises(ValueError, match="biases"):
        QuantizedExperts(experts, lambda linear: linear)
