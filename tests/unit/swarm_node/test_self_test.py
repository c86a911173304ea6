"""The node's known-answer self-test: honest spans pass it (every family, float and quantized), and it refuses a
span whose cache keeps nothing, whose layers ignore the cache keyword, or whose quantized block is wrong."""

from __future__ import annotations

import pytest
import torch

from shared.model_source import load_config, resolve_model
from shared.weights import WeightReader, open_weights
from swarm_node.faults import wrong_weights
from swarm_node.quantize import block_transform
from swarm_node.self_test import SelfTestFailed, run_self_test
from swarm_node.span import BlockSpan, BlockTransform, build_span
from tests.tiny_models import GetTinyModel


def _load(
    tiny_model: GetTinyModel,
    variant: str,
    dtype: torch.dtype = torch.float32,
    transform: BlockTransform | None = None,
) -> tuple[BlockSpan, object, WeightReader]:
    source = resolve_model(str(tiny_model(variant).folder))
    config = load_config(source)
    reader = open_weights(source, config)
    return build_span(config, reader, 1, 4, dtype, "cpu", transform), config, reader


def test_every_honest_float_span_passes(tiny_model: GetTinyModel, tiny_variant: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        span, config, reader = _load(tiny_model, tiny_variant, dtype)
        checks = run_self_test(span, config, reader, "none")  # type: ignore[arg-type]
        assert [check.passed for check in checks] == [True]


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_honest_quantized_spans_pass_and_every_block_is_checked(tiny_model: GetTinyModel, quant: str) -> None:
    transform = block_transform(quant, torch.float32, torch.device("cpu"))  # type: ignore[arg-type]
    span, config, reader = _load(tiny_model, "llama", transform=transform)
    checks = run_self_test(span, config, reader, quant)  # type: ignore[arg-type]
    assert [check.name.split(" in ")[0] for check in checks[1:]] == ["block 1", "block 2", "block 3"]
    assert all(0 < check.error <= check.tolerance for check in checks[1:])


@pytest.mark.parametrize("variant", ["llama", "falcon", "bloom", "gemma2"])
def test_a_cache_that_keeps_nothing_fails_in_plain_words(tiny_model: GetTinyModel, variant: str) -> None:
    span, config, reader = _load(tiny_model, variant)
    span.forget_kv = True  # --faulty-outputs stale-cache
    with pytest.raises(
        SelfTestFailed, match="decode after a prefill of 7 positions is off by .*KV cache does not keep"
    ):
        run_self_test(span, config, reader, "none")  # type: ignore[arg-type]


def test_a_layer_that_ignores_the_cache_keyword_fails(tiny_model: GetTinyModel) -> None:
    span, config, reader = _load(tiny_model, "qwen2")
    span.cache_keyword = "past_key_values_of_another_release"  # swallowed by the layer's **kwargs, as under 5.17
    with pytest.raises(SelfTestFailed, match="the KV cache is not written: blocks \\[1, 2, 3\\] stored \\[0\\]"):
        run_self_test(span, config, reader, "none")  # type: ignore[arg-type]


def test_a_quantized_block_with_wrong_weights_fails(tiny_model: GetTinyModel) -> None:
    transform = wrong_weights(block_transform("int8", torch.float32, torch.device("cpu")))
    span, config, reader = _load(tiny_model, "llama", transform=transform)
    with pytest.raises(SelfTestFailed, match=r"^block 1 in int8 against its float weights is off by [0-9.]+ relative"):
        run_self_test(span, config, reader, "int8")  # type: ignore[arg-type]


def test_what_it_cannot_see_a_float_span_with_wrong_weights_passes(tiny_model: GetTinyModel) -> None:
    """Consistent with itself: only another replica can tell (the gateway's probation)."""
    span, config, reader = _load(tiny_model, "llama", transform=wrong_weights(None))
    assert all(check.passed for check in run_self_test(span, config, reader, "none"))  # type: ignore[arg-type]
