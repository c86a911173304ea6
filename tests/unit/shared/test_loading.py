"""Slice loading: a span reads only its own blocks' tensors, from only the files that hold them, in every format.

Formats: a local safetensors folder (sharded or not), a hub repo (downloads only the index and the needed shards),
a GGUF file written here the way llama.cpp's converter writes one, and the real bundled SmolLM2 GGUF.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

import shared.weights
from gateway.model.head import build_head
from shared.errors import ModelLoadError
from shared.model_source import ModelSource, load_config, resolve_model
from shared.weights import SAFETENSORS_INDEX, GgufReader, WeightReader, open_weights
from swarm_node.span import BlockSpan, build_span
from tests.helpers.smollm2 import load_reference
from tests.tiny_models import _COMMON, NUM_LAYERS, VOCAB, GetTinyModel, TinyModel

MOE_GGUF_COMMON: dict[str, Any] = {**_COMMON, "num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}

BLOCK = re.compile(r"^(?:model\.layers|transformer\.h)\.(\d+)\.")


def blocks_of(names: list[str]) -> set[int | None]:
    """Block index of each tensor name; None for tensors outside the blocks (embeddings, final norm, LM head)."""
    blocks: set[int | None] = set()
    for name in names:
        match = BLOCK.match(name)
        blocks.add(int(match.group(1)) if match else None)
    return blocks


def open_source(spec: str) -> tuple[PretrainedConfig, WeightReader]:
    source = resolve_model(spec)
    config = load_config(source)
    return config, open_weights(source, config)


def weight_map(folder: Path) -> dict[str, str]:
    return dict(json.loads((folder / SAFETENSORS_INDEX).read_text())["weight_map"])


def run_chain(
    config: PretrainedConfig, readers: list[WeightReader], bounds: list[int], ids: torch.Tensor
) -> torch.Tensor:
    """Logits [1, T, V] of ids through the head of readers[0] and spans bounds[i]:bounds[i+1] of readers[i]."""
    head = build_head(config, readers[0])
    hidden = head.embed(ids)
    for reader, start, end in zip(readers, bounds, bounds[1:], strict=False):
        span = build_span(config, reader, start, end)
        hidden = span(hidden, [span.new_session_kv(range(start, end), ids.shape[1])], [0], range(start, end))
    return head.logits(hidden)


# --- safetensors folders -------------------------------------------------------------------------------------


@pytest.fixture
def opened_files(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Base names of every safetensors file our readers open, in order."""
    opened: list[str] = []
    real_safe_open = shared.weights.safe_open

    def recording_safe_open(path: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(path).name)
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(shared.weights, "safe_open", recording_safe_open)
    return opened


def test_span_of_a_sharded_folder_reads_only_its_blocks_from_only_their_shards(
    sharded_llama: TinyModel, opened_files: list[str]
) -> None:
    shards = weight_map(sharded_llama.folder)
    assert len(set(shards.values())) > 5, "the fixture should be split into many shards"

    config, reader = open_source(str(sharded_llama.folder))
    span = build_span(config, reader, 0, 2)

    assert blocks_of(reader.loaded) == {0, 1}  # no other block, no embeddings
    assert sorted(reader.loaded) == sorted(name for name in shards if blocks_of([name]) <= {0, 1})
    assert set(opened_files) == {shards[name] for name in reader.loaded}
    assert len(set(opened_files)) < len(set(shards.values()))
    expected = sharded_llama.model.state_dict()
    for name, tensor in span.layers.state_dict().items():
        assert torch.equal(tensor, expected[f"model.layers.{name}"])


def test_head_reads_only_embeddings_norm_and_lm_head(sharded_llama: TinyModel) -> None:
    config, reader = open_source(str(sharded_llama.folder))
    build_head(config, reader)
    assert sorted(reader.loaded) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]


def test_tied_head_reuses_the_embedding_tensor(tiny_model: GetTinyModel) -> None:
    config, reader = open_source(str(tiny_model("llama_tied").folder))
    head = build_head(config, reader)
    assert "lm_head.weight" not in reader.loaded
    assert head.lm_head.weight.data_ptr() == head.embed_tokens.weight.data_ptr()


def test_sharded_and_single_file_folders_give_the_same_logits(
    sharded_llama: TinyModel, tiny_model: GetTinyModel
) -> None:
    single = tiny_model("llama")
    assert not (single.folder / SAFETENSORS_INDEX).exists()
    ids = torch.arange(9).view(1, -1)
    config, sharded_reader = open_source(str(sharded_llama.folder))
    _, single_reader = open_source(str(single.folder))
    got = run_chain(config, [sharded_reader, single_reader], [0, 3, NUM_LAYERS], ids)
    with torch.inference_mode():
        expected = single.model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# --- hub repos -------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, sharded_llama: TinyModel) -> list[str]:
    """Serves repo ``org/tiny-llama`` from the sharded folder through huggingface_hub's own functions.

    Returns the file names downloaded, in order. Only the two functions hub_reader calls are replaced; a call for
    another repo or revision fails the test.
    """
    import huggingface_hub

    downloaded: list[str] = []

    def check(repo_id: str, revision: str | None) -> None:
        assert (repo_id, revision) == ("org/tiny-llama", "main")

    def hf_hub_download(repo_id: str, filename: str, *, revision: str | None = None, **kwargs: Any) -> str:
        check(repo_id, revision)
        downloaded.append(filename)
        path = sharded_llama.folder / filename
        if not path.is_file():
            raise FileNotFoundError(filename)
        return str(path)

    def file_exists(repo_id: str, filename: str, *, revision: str | None = None, **kwargs: Any) -> bool:
        check(repo_id, revision)
        return (sharded_llama.folder / filename).is_file()

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "file_exists", file_exists)
    return downloaded


def test_hub_span_downloads_only_the_index_and_its_shards(sharded_llama: TinyModel, fake_hub: list[str]) -> None:
    source = resolve_model("org/tiny-llama", revision="main")
    assert source == ModelSource("hub", "org/tiny-llama", "main")
    assert source.name == "tiny-llama"
    config = load_config(resolve_model(str(sharded_llama.folder)))  # the hub config path needs the network
    reader = open_weights(source, config)
    build_span(config, reader, 2, 4)

    shards = weight_map(sharded_llama.folder)
    needed = {shards[name] for name in shards if blocks_of([name]) <= {2, 3}}
    assert blocks_of(reader.loaded) == {2, 3}
    assert fake_hub[0] == SAFETENSORS_INDEX
    assert set(fake_hub[1:]) == needed
    assert len(needed) < len(set(shards.values()))


# --- GGUF files ------------------------------------------------------------------------------------------------


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF rotary halves -> interleaved pairs)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _llama_cpp_bloom_qkv(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's BLOOM conversion: per-head interleaved q/k/v rows -> all queries, all keys, all values."""
    parts = weights.reshape(heads, 3, weights.shape[0] // heads // 3, *weights.shape[1:])
    return np.concatenate([parts[:, i].reshape(-1, *weights.shape[1:]) for i in range(3)])


def _add_metadata(writer: gguf.GGUFWriter, config: PretrainedConfig, arch: gguf.MODEL_ARCH) -> None:
    """The metadata llama.cpp writes for the arch that transformers builds the config from."""
    if arch == gguf.MODEL_ARCH.BLOOM:
        writer.add_context_length(2048)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(4 * config.hidden_size)
        writer.add_head_count(config.n_head)
        writer.add_head_count_kv(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    if arch == gguf.MODEL_ARCH.FALCON:  # Falcon 7B's shape: one key/value head (multi-query), parallel attention
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(4 * config.hidden_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(1)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3, gguf.MODEL_ARCH.QWEN3MOE):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        writer.add_sliding_window(config.sliding_window)
    if arch in (gguf.MODEL_ARCH.QWEN2MOE, gguf.MODEL_ARCH.QWEN3MOE):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _llama_cpp_tensor(hf_name: str, weights: np.ndarray, config: PretrainedConfig, arch: gguf.MODEL_ARCH) -> np.ndarray:
    """A tensor as llama.cpp's converter rewrites it for the arch."""
    if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("q_proj.weight"):
        return _llama_cpp_permute(weights, config.num_attention_heads)
    if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("k_proj.weight"):
        return _llama_cpp_permute(weights, config.num_key_value_heads)
    if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3) and hf_name.endswith("norm.weight"):
        return weights + 1  # Gemma's norms scale by 1 + w; llama.cpp's by w
    if arch == gguf.MODEL_ARCH.BLOOM and "query_key_value" in hf_name:
        return _llama_cpp_bloom_qkv(weights, config.n_head)
    if hf_name.endswith("shared_expert_gate.weight"):
        return weights[0]  # [1, D] -> [D]
    return weights


def _gguf_tensors(hf_name: str, names: Any) -> list[tuple[str, slice | None]]:
    """(GGUF name, the rows of dimension 1 it takes) of one HF tensor: fused experts split into llama.cpp's stacks."""
    stacked = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", hf_name)
    if stacked is None:
        suffixes = (".weight", ".bias")
        gguf_name = names.get_name(hf_name, try_suffixes=suffixes)
        gguf_name = gguf_name or names.get_name(hf_name.removeprefix("transformer."), try_suffixes=suffixes)
        assert gguf_name is not None, hf_name
        return [(gguf_name, None)]
    block, kind = stacked.groups()
    if kind == "down_proj":
        return [(f"blk.{block}.ffn_down_exps.weight", None)]
    return [(f"blk.{block}.ffn_gate_exps.weight", slice(0, 1)), (f"blk.{block}.ffn_up_exps.weight", slice(1, 2))]


def write_gguf(model: PreTrainedModel, path: Path, arch: gguf.MODEL_ARCH, float16: bool, name: str) -> None:
    """Writes ``model`` as llama.cpp's converter would: the arch's metadata, GGUF tensor names, tensors rewritten
    as it rewrites them (Q/K rows permuted for the llama arch, Gemma's norms + 1, BLOOM's q/k/v regrouped),
    matrices in F16 (``float16``) or F32 and norms / biases in F32, no output tensor when the embeddings are tied.
    ``name`` is ``general.name``: transformers reads a llama-arch file as Mistral only when that field is exactly
    "mistral"."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name)
    _add_metadata(writer, config, arch)
    writer.add_vocab_size(config.vocab_size)
    if arch == gguf.MODEL_ARCH.PHI3:  # transformers' Phi-3 GGUF default pad id (32000) lies outside a tiny vocab
        writer.add_pad_token_id(0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if float16 else gguf.LlamaFileType.ALL_F32)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weights = _llama_cpp_tensor(hf_name, tensor.numpy(), config, arch)
        if float16 and weights.ndim >= 2:
            weights = weights.astype(np.float16)
        for gguf_name, half in _gguf_tensors(hf_name, names):
            if half is not None:  # [E, 2I, D]: gate rows, then up rows
                rows = weights.shape[1] // 2
                weights_part = weights[:, half.start * rows : half.stop * rows]
                writer.add_tensor(gguf_name, np.ascontiguousarray(weights_part))
            else:
                writer.add_tensor(gguf_name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass(frozen=True)
class GgufCase:
    variant: str
    arch: gguf.MODEL_ARCH
    float16: bool  # matrices in F16 (they round) rather than F32 (exact)
    # transformers cannot load a Mistral GGUF itself (gguf-py has no "mistral" arch to map its tensor names); there
    # the reference is transformers' model built from the config read from the file, holding the original weights.
    transformers_loads: bool = True


@dataclass(frozen=True)
class TinyGguf:
    path: Path
    tiny: TinyModel
    case: GgufCase

    def reference_model(self, config: PretrainedConfig) -> PreTrainedModel:
        if self.case.transformers_loads:
            folder, name = str(self.path.parent), self.path.name
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(self.tiny.model.state_dict())
        return model.eval()


GGUF_CASES = [
    # llama untied and tied (Q/K permuted), Mistral through llama.cpp's llama arch, Qwen2 with its q/k/v biases.
    pytest.param(GgufCase("llama", gguf.MODEL_ARCH.LLAMA, float16=False), id="llama-f32"),
    pytest.param(GgufCase("llama_tied", gguf.MODEL_ARCH.LLAMA, float16=True), id="llama_tied-f16"),
    pytest.param(GgufCase("mistral", gguf.MODEL_ARCH.LLAMA, float16=False, transformers_loads=False), id="mistral-f32"),
    pytest.param(GgufCase("qwen2", gguf.MODEL_ARCH.QWEN2, float16=False), id="qwen2-f32"),
    # Phi-3: fused qkv and gate_up projections under their own GGUF names.
    pytest.param(GgufCase("phi3", gguf.MODEL_ARCH.PHI3, float16=True), id="phi3-f16"),
    # Families whose tensors llama.cpp rewrites: Gemma 2 / 3 (norms + 1), BLOOM (q/k/v regrouped, weight and bias).
    pytest.param(GgufCase("gemma2", gguf.MODEL_ARCH.GEMMA2, float16=False), id="gemma2-f32"),
    pytest.param(GgufCase("gemma3", gguf.MODEL_ARCH.GEMMA3, float16=True), id="gemma3-f16"),
    pytest.param(GgufCase("bloom", gguf.MODEL_ARCH.BLOOM, float16=False), id="bloom-f32"),
    # Falcon 7B's architecture (multi-query: llama.cpp's q/k/v regrouping leaves its rows as they are).
    pytest.param(GgufCase("falcon", gguf.MODEL_ARCH.FALCON, float16=True), id="falcon-f16"),
    # Experts stacked per block (ffn_{gate,up,down}_exps); Qwen2-MoE's shared expert gate stored as a vector.
    pytest.param(GgufCase("qwen2_moe_gguf", gguf.MODEL_ARCH.QWEN2MOE, float16=False), id="qwen2_moe-f32"),
    pytest.param(GgufCase("qwen3_moe_gguf", gguf.MODEL_ARCH.QWEN3MOE, float16=True), id="qwen3_moe-f16"),
]

# transformers reads neither expert width from a GGUF file (its config keeps the defaults: Qwen2-MoE 1408 / 5632,
# Qwen3-MoE 768, the flagship models' widths), so MoE files are tested at those widths.
GGUF_ONLY_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen2_moe_gguf": lambda: Qwen2MoeConfig(**MOE_GGUF_COMMON),
    "qwen3_moe_gguf": lambda: Qwen3MoeConfig(**MOE_GGUF_COMMON),
}


@pytest.fixture(params=GGUF_CASES)
def tiny_gguf(request: pytest.FixtureRequest, tiny_model: GetTinyModel, tmp_path: Path) -> TinyGguf:
    case: GgufCase = request.param
    if case.variant in GGUF_ONLY_MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(GGUF_ONLY_MODELS[case.variant](), dtype=torch.float32).eval()
        tiny = TinyModel(tmp_path, model)
    else:
        tiny = tiny_model(case.variant)
    path = tmp_path / f"tiny-{case.variant}.gguf"
    write_gguf(tiny.model, path, case.arch, case.float16, name=tiny.model.config.model_type)
    return TinyGguf(path, tiny, case)


def test_gguf_tensors_equal_the_reference(tiny_gguf: TinyGguf) -> None:
    config, reader = open_source(str(tiny_gguf.path))
    assert isinstance(reader, GgufReader)
    original = tiny_gguf.tiny.model
    assert config.model_type == original.config.model_type
    assert config.tie_word_embeddings == original.config.tie_word_embeddings
    reference = tiny_gguf.reference_model(config).state_dict()

    ours = reader.read(sorted(reader.names()))
    assert set(ours) == set(reference) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name
        # Q/K went through llama.cpp's permutation and our inverse; F16 only rounds.
        expected = original.state_dict()[name]
        tolerance = 1e-3 * float(expected.abs().max()) if tiny_gguf.case.float16 else 0.0
        torch.testing.assert_close(tensor, expected, atol=tolerance, rtol=0)


def test_gguf_span_reads_only_its_blocks(tiny_gguf: TinyGguf) -> None:
    config, reader = open_source(str(tiny_gguf.path))
    build_span(config, reader, 1, 3)
    assert blocks_of(reader.loaded) == {1, 2}


def test_gguf_chain_logits_equal_the_reference(tiny_gguf: TinyGguf) -> None:
    config, _ = open_source(str(tiny_gguf.path))
    readers = [open_source(str(tiny_gguf.path))[1] for _ in range(2)]
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    got = run_chain(config, readers, [0, 4, NUM_LAYERS], ids)
    with torch.inference_mode():
        expected = tiny_gguf.reference_model(config)(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_smollm2_gguf_spans_load_only_their_blocks_and_generate_like_transformers(smollm2_gguf: Path) -> None:
    # One reader for all three parts (opening the file parses its large tokenizer metadata: seconds each time);
    # reader.loaded grows in order, so each part's names are the slice it added.
    config, reader = open_source(str(smollm2_gguf))
    assert config.num_hidden_layers == 30
    first = build_span(config, reader, 0, 15)
    assert blocks_of(reader.loaded) == set(range(15))
    before = len(reader.loaded)
    second = build_span(config, reader, 15, 30)
    assert blocks_of(reader.loaded[before:]) == set(range(15, 30))
    before = len(reader.loaded)
    head = build_head(config, reader)
    assert blocks_of(reader.loaded[before:]) == {None}
    assert "lm_head.weight" not in reader.loaded  # SmolLM2 ties its embeddings

    reference_model, tokenizer = load_reference(smollm2_gguf)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        reference = reference_model.generate(prompt, max_new_tokens=8, do_sample=False)
    expected = reference[0, prompt.shape[1] :].tolist()
    assert len(expected) == 8

    sessions = [span.new_session_kv(range(span.start, span.end), 64) for span in (first, second)]
    tokens: list[int] = []
    step_ids, position = prompt, 0
    while len(tokens) < 8:
        hidden = head.embed(step_ids)
        for span, kv in zip((first, second), sessions, strict=True):
            hidden = span(hidden, [kv], [position], range(span.start, span.end))
        position += step_ids.shape[1]
        tokens.append(int(head.logits(hidden)[0, -1].argmax()))
        step_ids = torch.tensor([tokens[-1:]])
    assert tokens == expected, (tokenizer.decode(tokens), tokenizer.decode(expected))


# --- resolving MODEL strings -----------------------------------------------------------------------------------


def test_resolve_model_kinds_and_names(tiny_model: GetTinyModel, tmp_path: Path) -> None:
    folder = tiny_model("llama").folder
    assert resolve_model(str(folder)) == ModelSource("folder", str(folder.resolve()))
    assert resolve_model(str(folder) + "/").name == folder.name
    gguf_file = tmp_path / "My-Model.Q4_K.gguf"
    gguf_file.write_bytes(b"")
    assert resolve_model(str(gguf_file)).name == "My-Model.Q4_K"
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"


@pytest.mark.parametrize(
    "make_spec",
    [
        pytest.param(lambda tmp: _touch(tmp / "model.safetensors"), id="non-gguf-file"),
        pytest.param(lambda tmp: str(tmp), id="folder-without-config"),
        pytest.param(lambda tmp: "not a model: ???", id="garbage"),
        pytest.param(lambda tmp: str(tmp / "missing" / "model"), id="missing-path"),
    ],
)
def test_resolve_model_rejects_what_is_not_a_model(make_spec: Any, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        resolve_model(make_spec(tmp_path))


def test_load_config_of_a_broken_gguf_is_a_model_load_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError):
        load_config(resolve_model(str(broken)))


def test_span_outside_the_model_is_a_model_load_error(tiny_model: GetTinyModel) -> None:
    config, reader = open_source(str(tiny_model("llama").folder))
    with pytest.raises(ModelLoadError):
        build_span(config, reader, 4, NUM_LAYERS + 1)
    assert reader.loaded == []


def test_span_objects_are_block_spans(tiny_model: GetTinyModel) -> None:
    config, reader = open_source(str(tiny_model("qwen3").folder))
    span = build_span(config, reader, 0, 1)
    assert isinstance(span, BlockSpan)
    assert (span.start, span.end, span.hidden_size) == (0, 1, 64)


def _touch(path: Path) -> str:
    path.write_bytes(b"")
    return str(path)


def test_a_falcon_gguf_with_several_key_value_heads_is_refused(tiny_model: GetTinyModel, tmp_path: Path) -> None:
    """Falcon 40B's shape: transformers' config from the file says nothing of the new architecture; the file's
    key/value head count does."""
    config = load_config(resolve_model(str(tiny_model("falcon").folder)))
    path = tmp_path / "falcon-new.gguf"
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.FALCON])
    writer.add_head_count_kv(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="new decoder architecture"):
        GgufReader(str(path), config)
