"""Span-only loading for every family's checkpoint layout, and experts assembled from exactly a span's tensors.

Mixture-of-experts blocks are most of such a model: a node must still read only its own blocks' experts (one
tensor per expert and projection in hub checkpoints, fused by us into transformers' 3D expert tensors).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GPT2Config

from gateway.model.head import build_head
from shared.errors import ModelLoadError
from shared.families import family_of
from shared.model_source import load_config, resolve_model
from shared.weights import GgufReader, open_weights
from swarm_node.span import build_span, kv_bytes_per_token
from tests.tiny_models import TINY_VARIANTS, GetTinyModel

NEW_VARIANTS = [v for v in TINY_VARIANTS if v not in ("llama", "llama_tied", "mistral", "qwen2", "qwen3")]


@pytest.mark.parametrize("variant", NEW_VARIANTS)
def test_a_span_reads_exactly_its_blocks_tensors(tiny_model: GetTinyModel, variant: str) -> None:
    tiny = tiny_model(variant)
    source = resolve_model(str(tiny.folder))
    config = load_config(source)
    reader = open_weights(source, config)
    build_span(config, reader, 2, 4)
    with safe_open(str(tiny.folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    prefix = re.escape(family_of(config).layout.blocks)
    ours = {n for n in names if re.match(rf"^{prefix}\.[23]\.", n)}
    assert len(reader.loaded) == len(set(reader.loaded))  # each tensor read once
    assert set(reader.loaded) == ours  # every tensor of blocks 2 and 3, nothing of the others'
    if family_of(config).experts is not None:
        assert sum(".experts." in n for n in reader.loaded) == 2 * 3 * 4  # 2 blocks x 3 projections x 4 experts


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe"])
def test_fused_experts_equal_transformers_own(tiny_model: GetTinyModel, variant: str) -> None:
    tiny = tiny_model(variant)
    source = resolve_model(str(tiny.folder))
    config = load_config(source)
    span = build_span(config, open_weights(source, config), 1, 2)
    ours, theirs = span.layers["1"].mlp.experts, tiny.model.base_model.layers[1].mlp.experts
    assert torch.equal(ours.gate_up_proj, theirs.gate_up_proj) and torch.equal(ours.down_proj, theirs.down_proj)


def test_grouped_experts_one_matmul_per_expert_for_a_batch(
    tiny_model: GetTinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched decode of 6 sessions routes 12 (row, expert) pairs; each expert hit runs one matmul for its rows."""
    tiny = tiny_model("mixtral")
    source = resolve_model(str(tiny.folder))
    config = load_config(source)
    span = build_span(config, open_weights(source, config), 0, 1)
    experts = span.layers["0"].mlp.experts
    rows_per_call: list[int] = []
    linear = torch.nn.functional.linear

    def counting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.untyped_storage().data_ptr() == experts.gate_up_proj.untyped_storage().data_ptr():
            rows_per_call.append(x.shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    sessions = [span.new_session_kv(range(0, 1), 8) for _ in range(6)]
    hidden = torch.randn(6, 1, config.hidden_size, generator=torch.Generator().manual_seed(0))
    span(hidden, sessions, [0] * 6, range(0, 1))
    assert sum(rows_per_call) == 6 * config.num_experts_per_tok  # every routed row once
    assert len(rows_per_call) <= config.num_local_experts < 6 * config.num_experts_per_tok  # grouped by expert


def test_falcon_new_architecture_caches_each_key_value_head_once(tiny_model: GetTinyModel) -> None:
    """Its layers hand the cache every key/value head repeated per query group; the cache keeps one copy."""
    source = resolve_model(str(tiny_model("falcon_new").folder))
    config = load_config(source)
    span = build_span(config, open_weights(source, config), 0, 2)
    session = span.new_session_kv(range(0, 2), 8)
    assert session.keys.shape == (2, config.num_kv_heads, 8, config.hidden_size // config.num_attention_heads)
    assert config.num_kv_heads < config.num_attention_heads
    assert kv_bytes_per_token(config, 2, torch.float32) == 2 * 2 * config.num_kv_heads * 16 * 4


def test_bloom_checkpoint_without_the_transformer_prefix(tiny_model: GetTinyModel, tmp_path: Path) -> None:
    """bigscience/bloom-* name their tensors ``h.0.…`` / ``word_embeddings.weight``, without ``transformer.``."""
    tiny = tiny_model("bloom")
    state = {name.removeprefix("transformer."): t.contiguous() for name, t in tiny.model.state_dict().items()}
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny.folder / "config.json", tmp_path / "config.json")
    source = resolve_model(str(tmp_path))
    config = load_config(source)
    reader = open_weights(source, config)
    head, span = build_head(config, reader), build_span(config, reader, 0, config.num_hidden_layers)
    ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    blocks = range(0, config.num_hidden_layers)
    logits = head.logits(span(head.embed(ids), [span.new_session_kv(blocks, 9)], [0], blocks))
    with torch.inference_mode():
        torch.testing.assert_close(logits, tiny.model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["mixtral", "falcon_new"])
def test_gguf_of_families_we_cannot_read_right_is_refused(tiny_model: GetTinyModel, variant: str) -> None:
    """Mixtral (under llama.cpp's llama arch; transformers' GGUF loader has no Mixtral) and Falcon's new architecture
    (q/k/v regrouped, which transformers leaves as is): refused, not served wrong."""
    config = load_config(resolve_model(str(tiny_model(variant).folder)))
    with pytest.raises(ModelLoadError, match="GGUF files"):
        GgufReader("unused.gguf", config)


def test_a_process_imports_only_its_own_familys_modeling_module(smollm2_gguf: Path) -> None:
    """A fresh interpreter that builds SmolLM2's span and self-tests it, as a node does, imports modeling_llama and
    no other family's modeling module (each one costs an import at start)."""
    script = f"""
import sys
import torch
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.self_test import run_self_test
from swarm_node.server import SpanServer
from swarm_node.span import build_span
source = resolve_model({str(smollm2_gguf)!r})
config = load_config(source)
span = build_span(config, open_weights(source, config), 0, 2, torch.float32, torch.device("cpu"))
run_self_test(span, config, open_weights(source, config), "none")
print(sorted(name.rsplit(".", 1)[1] for name in sys.modules if name.startswith("transformers.models.")
             and name.rsplit(".", 1)[1].startswith("modeling_")))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=400, env={**os.environ}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    modules = ast.literal_eval(result.stdout.splitlines()[-1])
    assert [module for module in modules if module != "modeling_auto"] == ["modeling_llama"]  # auto: no family


def test_an_unknown_model_type_names_the_supported_ones() -> None:
    config = GPT2Config(n_layer=2)
    with pytest.raises(ModelLoadError, match=r"'gpt2' is not supported \(supported: bloom, falcon, .*qwen3_moe\)"):
        family_of(config)
