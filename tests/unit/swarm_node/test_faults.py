"""The healthy-looking ``--faulty-outputs`` modes: each answers well-formed hidden states that are wrong the way it
says (the gateway's probation and spot checks are tested against them, and need them to lie exactly so)."""

from __future__ import annotations

import torch

from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.backend import SpanBackend
from swarm_node.faults import NOISE_RELATIVE, computed_quant, lie_about, wrong_weights
from swarm_node.span import BlockSpan, build_span
from tests.tiny_models import GetTinyModel

PROMPT = 6


def _span(tiny_model: GetTinyModel, transform: object = None) -> BlockSpan:
    source = resolve_model(str(tiny_model("llama").folder))
    config = load_config(source)
    return build_span(config, open_weights(source, config), 0, 3, transform=transform)  # type: ignore[arg-type]


def _hidden(span: BlockSpan, tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, tokens, span.hidden_size, generator=torch.Generator().manual_seed(seed))


def _prefill_then_decode(span: BlockSpan) -> torch.Tensor:
    """The decode output at position PROMPT after a prefill of PROMPT positions."""
    blocks = range(span.start, span.end)
    kv = span.new_session_kv(blocks, PROMPT + 1)
    span(_hidden(span, PROMPT), [kv], [0], blocks)
    return span(_hidden(span, 1, seed=1), [kv], [PROMPT], blocks)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_noise_is_one_percent_relative_and_lazy_answers_its_input() -> None:
    inputs, output = torch.randn(2, 3, 64), torch.randn(2, 3, 64) * 5
    noisy = lie_about("noise", inputs, output)
    assert noisy.shape == output.shape and noisy.dtype == output.dtype
    assert 0.5 * NOISE_RELATIVE < _relative(noisy, output) < 2 * NOISE_RELATIVE
    assert torch.equal(lie_about("lazy", inputs, output), inputs)
    assert lie_about("none", inputs, output) is output


async def test_a_noisy_backend_lies_in_every_forward(tiny_model: GetTinyModel) -> None:
    span = _span(tiny_model)
    honest = await SpanBackend(span).forward(_hidden(span, PROMPT), range(0, 3))
    noisy = await SpanBackend(span, fault="noise").forward(_hidden(span, PROMPT), range(0, 3))
    assert 0.5 * NOISE_RELATIVE < _relative(noisy, honest) < 2 * NOISE_RELATIVE


def test_stale_cache_keeps_no_keys_so_decode_goes_wrong(tiny_model: GetTinyModel) -> None:
    span = _span(tiny_model)
    honest = _prefill_then_decode(span)
    span.forget_kv = True
    stale = _prefill_then_decode(span)
    assert stale.shape == honest.shape and torch.isfinite(stale).all()
    assert _relative(stale, honest) > 0.05


def test_wrong_weights_redraws_the_first_block_only(tiny_model: GetTinyModel) -> None:
    honest, wrong = _span(tiny_model), _span(tiny_model, wrong_weights(None))
    first = [(a, b) for a, b in zip(honest.layers["0"].parameters(), wrong.layers["0"].parameters(), strict=True)]
    assert any(not torch.equal(a, b) for a, b in first)
    for block in ("1", "2"):
        assert all(
            torch.equal(a, b)
            for a, b in zip(honest.layers[block].parameters(), wrong.layers[block].parameters(), strict=True)
        )
    a, b = next(iter(honest.layers["0"].parameters())), next(iter(wrong.layers["0"].parameters()))
    assert (
        abs(float(a.detach().std()) / float(b.detach().std()) - 1) < 0.2
    )  # the same scale: nothing looks off by magnitude


def test_low_precision_computes_nf4_whatever_it_announces() -> None:
    assert computed_quant("low-precision", "none") == "nf4"
    assert computed_quant("none", "none") == "none"
    assert computed_quant("noise", "int8") == "int8"
