"""Quantized spans (bitsandbytes LLM.int8 / NF4 on the CPU) stay within a stated tolerance of the unquantized span.

Tolerances, measured against the float32 span on the same input:

* tiny random models, hidden states after all 6 blocks, relative error ||q - ref|| / ||ref||:
  int8 <= 0.10 (measured 0.03-0.05), nf4 <= 0.50 (measured 0.27-0.38; NF4 alone is ~0.09 per matrix on normal
  weights, and random blocks compound it);
* SmolLM2-135M (whose GGUF weights are already 4-bit), next-token distributions at every prompt position, mean
  KL(ref || quantized) in nats: int8 <= 0.2 (measured 0.03-0.07), nf4 <= 2.0 (measured 0.3-1.4) — and greedy
  answers stay right: both still say Paris.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from bitsandbytes.nn.modules import Linear4bit, Linear8bitLt
from torch import nn
from torch.nn.functional import kl_div

from gateway.model.head import ModelHead, build_head
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.cpu_projections import TransposedLinear, keep_batched_copy, onednn_pays_for_batches
from swarm_node.quantize import QUANTIZED_PROJECTIONS, Quant, block_transform, resolve_quant
from swarm_node.span import BlockSpan, build_span
from tests.helpers.smollm2 import load_tokenizer
from tests.tiny_models import GetTinyModel

TINY_TOLERANCE = {"int8": 0.10, "nf4": 0.50}
SMOLLM2_KL = {"int8": 0.2, "nf4": 2.0}
QUANT_MODULES: dict[str, type[nn.Module]] = {"int8": Linear8bitLt, "nf4": Linear4bit}


def forward_all(span: BlockSpan, hidden: torch.Tensor) -> torch.Tensor:
    blocks = range(span.start, span.end)
    return span(hidden, [span.new_session_kv(blocks, hidden.shape[1])], [0], blocks)


def test_plain_cpu_projections_are_stored_transposed_with_the_same_results(tiny_model: GetTinyModel) -> None:
    source = resolve_model(str(tiny_model("qwen2").folder))
    config = load_config(source)
    hidden = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    plain = build_span(config, open_weights(source, config), 0, 6)
    layout = block_transform("none", torch.float32, torch.device("cpu"))
    transposed = build_span(config, open_weights(source, config), 0, 6, transform=layout)
    spans = (plain, transposed)
    assert block_transform("none", torch.float32, torch.device("cuda")) is None
    assert sum(isinstance(m, TransposedLinear) for m in transposed.modules()) == 6 * 7  # q k v o gate up down
    blocks = range(0, 6)
    outputs = [span(hidden, [span.new_session_kv(blocks, 9) for _ in hidden], [0, 0], blocks) for span in spans]
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bias", [False, True])
def test_the_batched_onednn_copy_gives_the_single_row_layouts_results(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    plain, dual = TransposedLinear(linear), TransposedLinear(linear, batched_copy=True)
    assert plain.batched is None and dual.batched is not None
    batched_rows: list[int] = []
    dual.batched.register_forward_hook(lambda _module, args, _out: batched_rows.append(args[0].shape[0]))
    for rows in (1, 3, 8):
        x = torch.randn(rows, 1, 48)
        reference = torch.nn.functional.linear(x, linear.weight, linear.bias)
        torch.testing.assert_close(plain(x), reference, atol=1e-5, rtol=0)
        torch.testing.assert_close(dual(x), reference, atol=1e-5, rtol=0)
    assert batched_rows == [3, 8]  # batches took the oneDNN copy; the single row did not
    one = torch.randn(1, 1, 48)
    assert torch.equal(dual(one), plain(one))  # a single row never takes the batched kernel


def test_cpu_batched_copy_setting_is_obeyed_where_onednn_can_take_the_weights(tiny_model: GetTinyModel) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert keep_batched_copy(torch.float32, cpu, "on") and not keep_batched_copy(torch.float32, cpu, "off")
    assert keep_batched_copy(torch.float32, cpu, "auto") == onednn_pays_for_batches()  # the probe decides
    assert not keep_batched_copy(torch.bfloat16, cpu, "on") and not keep_batched_copy(torch.float32, cuda, "on")
    source = resolve_model(str(tiny_model("llama").folder))
    config = load_config(source)
    for setting, kept in (("on", True), ("off", False)):
        layout = block_transform("none", torch.float32, cpu, setting)
        span = build_span(config, open_weights(source, config), 0, 2, transform=layout)
        layers = [m for m in span.modules() if isinstance(m, TransposedLinear)]
        assert layers and all((m.batched is not None) == kept for m in layers), setting


def test_auto_quantizes_on_cuda_only() -> None:
    assert resolve_quant("auto", torch.device("cpu")) == "none"
    assert resolve_quant("auto", torch.device("cuda")) == "nf4"
    assert resolve_quant("int8", torch.device("cpu")) == "int8"


# qwen2: projections with biases; phi3: fused qkv / gate_up; falcon_new, bloom: their own names (BLOOM with biases);
# gemma2: soft-capped attention; mixtral: experts quantized one linear each.
QUANT_VARIANTS = ["llama", "qwen2", "phi3", "falcon_new", "bloom", "gemma2", "mixtral"]


@pytest.mark.parametrize("variant", QUANT_VARIANTS)
@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_tiny_quantized_span_is_within_tolerance(tiny_model: GetTinyModel, variant: str, quant: Quant) -> None:
    source = resolve_model(str(tiny_model(variant).folder))
    config = load_config(source)
    hidden = torch.randn(1, 13, config.hidden_size, generator=torch.Generator().manual_seed(0))
    plain = build_span(config, open_weights(source, config), 0, 6)
    projections = {n for n, m in plain.named_modules() if isinstance(m, nn.Linear)}
    reference = forward_all(plain, hidden)
    span = build_span(config, open_weights(source, config), 0, 6, transform=block_transform(quant, torch.float32))

    quantized = {name for name, module in span.named_modules() if isinstance(module, QUANT_MODULES[quant])}
    quant_type = QUANT_MODULES[quant]
    linear = {n for n, m in span.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, quant_type)}
    experts = {name for name in quantized if ".experts." in name}  # MoE: one linear per expert and projection
    assert quantized - experts == projections and not linear  # every linear layer of these blocks, and the experts
    assert {name.rsplit(".", 1)[-1] for name in quantized - experts} <= QUANTIZED_PROJECTIONS
    assert len(experts) == 6 * 2 * getattr(config, "num_local_experts", 0)
    assert not any(param.dim() == 3 for param in span.parameters())  # no unquantized expert tensor is left
    output = forward_all(span, hidden)
    error = float((output - reference).norm() / reference.norm())
    assert 0 < error <= TINY_TOLERANCE[quant]


class MemoryReader:
    """Serves tensors read once from another reader: the GGUF is dequantized once, not once per span built."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.loaded: list[str] = []

    def names(self) -> set[str]:
        return set(self.tensors)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name] for name in names}


@pytest.mark.slow
def test_smollm2_quantized_spans_stay_close_and_sensible(smollm2_gguf: Path) -> None:
    source = resolve_model(str(smollm2_gguf))
    config = load_config(source)
    gguf = open_weights(source, config)
    head = build_head(config, gguf)
    reader = MemoryReader(gguf.read(sorted(name for name in gguf.names() if name.startswith("model.layers."))))
    tokenizer = load_tokenizer(smollm2_gguf)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", chat)]
    reference = None
    for quant in ("none", "int8", "nf4"):
        span = build_span(config, reader, 0, 30, transform=block_transform(quant, torch.float32))
        logits = [head.logits(forward_all(span, head.embed(torch.tensor([ids]))))[0] for ids in prompts]
        if reference is None:
            reference = logits
        else:
            kl = [
                float(kl_div(q.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="batchmean"))
                for q, r in zip(logits, reference, strict=True)
            ]
            assert sum(kl) / len(kl) <= SMOLLM2_KL[quant], (quant, kl)
        answers = [tokenizer.decode(greedy(span, head, ids, 6)) for ids in prompts]
        assert answers[0].strip().startswith("Paris"), (quant, answers)
        assert "Paris" in answers[1], (quant, answers)


def greedy(span: BlockSpan, head: ModelHead, prompt: list[int], new_tokens: int) -> list[int]:
    blocks = range(span.start, span.end)
    kv = span.new_session_kv(blocks, len(prompt) + new_tokens)
    logits = head.logits(span(head.embed(torch.tensor([prompt])), [kv], [0], blocks))
    tokens: list[int] = []
    for _ in range(new_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        logits = head.logits(span(head.embed(torch.tensor([tokens[-1:]])), [kv], [kv.length], blocks))
    return tokens
