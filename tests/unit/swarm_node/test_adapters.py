"""LoRA adapters on spans and the gateway's head equal PEFT's own model, row by row, in batches that mix them.

Each family's adapters are made by PEFT (random A and B), saved, and loaded the way nodes and the gateway load them:
the span's blocks only on the node, the embeddings and LM head on the gateway. A batch mixes rows of two adapters and
of the base model, at different lengths; every row's logits equal PEFT's for that row alone.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gateway.model.head import ModelHead, build_head
from gateway.model.head_adapters import load_head_adapters
from shared.errors import ModelLoadError
from shared.lora import LoraAdapter, LoraPair, parse_adapter_specs
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.adapters import AdapterRows, LoraLinear, load_span_adapters
from swarm_node.quantize import block_transform
from swarm_node.span import BlockSpan, build_span
from tests.helpers.adapters import ADAPTER_ONE, ADAPTER_TWO, TinyAdapter, make_adapter
from tests.tiny_models import VOCAB, GetTinyModel

ATOL = 1e-4
MAX_LENGTH = 32
NEW_TOKENS = 6

# Per family, the module names of ADAPTER_ONE / ADAPTER_TWO's targets (Falcon and BLOOM fuse q/k/v).
RENAMES: dict[str, dict[str, str]] = {
    "llama": {},
    # The shared expert's linears, named in full: the routed experts are fused tensors, not linears, and PEFT 0.22
    # turns a bare "down_proj" into a target of those tensors too (``target_parameters``, which we refuse).
    "qwen2_moe": {p: f"shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")},
    "bloom": {
        "q_proj": "query_key_value",
        "v_proj": "dense_h_to_4h",
        "down_proj": "dense_4h_to_h",
        "embed_tokens": "word_embeddings",
        "k_proj": "dense",
        "o_proj": "dense",
        "gate_proj": "query_key_value",
        "up_proj": "dense_h_to_4h",
    },
}


def _targets(variant: str, lora: dict[str, Any]) -> dict[str, Any]:
    names = RENAMES[variant]
    renamed = dict(lora, target_modules=sorted({names.get(m, m) for m in lora["target_modules"]}))
    for key in ("rank_pattern", "alpha_pattern"):
        if key in lora:
            renamed[key] = {names.get(m, m): v for m, v in lora[key].items()}
    return renamed


class Swarm:
    """A two-span chain and a head with both adapters, as a node pair and a gateway would hold them."""

    def __init__(self, folder: Path, adapters: dict[str, Path], cut: int, transform: Any = None) -> None:
        source = resolve_model(str(folder))
        config = load_config(source)
        reader = open_weights(source, config)
        self.head: ModelHead = build_head(config, reader)
        self.head.adapters = load_head_adapters(adapters, config)
        self.spans: list[BlockSpan] = []
        for start, end in ((0, cut), (cut, config.num_hidden_layers)):
            prefixes = [config_prefix(config, block) for block in range(start, end)]
            loaded = load_span_adapters(adapters, prefixes)
            self.spans.append(build_span(config, reader, start, end, transform=transform, adapters=loaded))

    def run(self, prompts: list[list[int]], names: list[str | None], new_tokens: int) -> list[list[torch.Tensor]]:
        """Greedy-decode every row in one batch; per row, the logits [V] at each prompt and generated position."""
        sessions = [
            [span.new_session_kv(range(span.start, span.end), MAX_LENGTH, name) for span in self.spans]
            for name in names
        ]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        hidden = torch.cat([self.head.embed(ids[row : row + 1], name) for row, name in enumerate(names)])
        lengths = [len(p) for p in prompts]
        logits = self._logits(self._blocks(hidden, sessions, [0] * len(names), lengths), names)
        seen = [[logits[row, t] for t in range(lengths[row])] for row in range(len(names))]
        positions = list(lengths)
        for _ in range(new_tokens):
            tokens = [int(row[-1].argmax()) for row in seen]
            hidden = torch.cat([self.head.embed(torch.tensor([[t]]), n) for t, n in zip(tokens, names, strict=True)])
            logits = self._logits(self._blocks(hidden, sessions, positions, None), names)
            for row in range(len(names)):
                seen[row].append(logits[row, 0])
            positions = [p + 1 for p in positions]
        return seen

    def _blocks(self, hidden: torch.Tensor, sessions: list[list[Any]], starts: list[int], lengths: Any) -> Any:
        for index, span in enumerate(self.spans):
            kvs = [session[index] for session in sessions]
            hidden = span(hidden, kvs, starts, range(span.start, span.end), lengths)
        return hidden

    def _logits(self, hidden: torch.Tensor, names: list[str | None]) -> torch.Tensor:
        return self.head.logits(hidden, names)


def config_prefix(config: Any, block: int) -> str:
    from shared.families import family_of

    return family_of(config).layout.block_prefix(block)


def reference(model: nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """PEFT's (or the base model's) logits [T, V] over the prompt and the generated tokens fed back."""
    with torch.inference_mode():
        return model(torch.tensor([prompt + generated])).logits[0]


@pytest.fixture(scope="module")
def adapters_of(tiny_model: GetTinyModel, tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, tuple[TinyAdapter, TinyAdapter]] = {}

    def get(variant: str) -> tuple[TinyAdapter, TinyAdapter]:
        if variant not in made:
            base = tiny_model(variant).model
            folder = tmp_path_factory.mktemp(f"adapters-{variant}")
            one = make_adapter(base, folder / "one", 1, **_targets(variant, ADAPTER_ONE))
            two = make_adapter(base, folder / "two", 2, **_targets(variant, ADAPTER_TWO))
            made[variant] = (one, two)
        return made[variant]

    return get


@pytest.mark.parametrize("variant", list(RENAMES))
def test_mixed_batch_rows_each_equal_peft_alone(tiny_model: GetTinyModel, adapters_of: Any, variant: str) -> None:
    tiny = tiny_model(variant)
    one, two = adapters_of(variant)
    swarm = Swarm(tiny.folder, {"one": one.folder, "two": two.folder}, cut=2)
    names: list[str | None] = ["one", None, "two", "one"]
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in (5, 8, 6, 3)]
    rows = swarm.run(prompts, names, NEW_TOKENS)
    models = {"one": one.model, None: tiny.model, "two": two.model}
    for row, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        ours = torch.stack(rows[row])  # [T, V]
        generated = [int(logits.argmax()) for logits in rows[row][len(prompt) - 1 : -1]]
        expected = reference(models[name], prompt, generated)
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    base = torch.stack(rows[1][: len(prompts[1])])
    adapted = reference(one.model, prompts[1], [])
    assert (base - adapted).abs().max() > 0.1  # the adapters change the answer: the test could fail


def test_the_update_is_added_on_top_of_a_quantized_layer(tiny_model: GetTinyModel, adapters_of: Any) -> None:
    tiny = tiny_model("llama")
    one, _ = adapters_of("llama")
    quantized = Swarm(tiny.folder, {"one": one.folder}, cut=3, transform=block_transform("int8", torch.float32))
    adapted = [m for m in quantized.spans[0].modules() if isinstance(m, LoraLinear)]
    assert adapted and all(type(m.base).__name__ != "Linear" for m in adapted)  # LoRA wraps the int8 layer
    layer = adapted[0]
    x = torch.randn(2, 3, layer.pairs["one"].a.shape[1])
    layer.rows.set(["one", None])
    try:
        out = layer(x)
    finally:
        layer.rows.clear()
    base = layer.base(x)
    torch.testing.assert_close(out[1], base[1])
    torch.testing.assert_close(out[0], base[0] + layer.pairs["one"].delta(x[0]), atol=1e-5, rtol=0)
    prompt = list(range(1, 9))
    ours = torch.stack(quantized.run([prompt], ["one"], 0)[0])
    expected = reference(one.model, prompt, [])
    error = float((ours - expected).norm() / expected.norm())
    plain = reference(tiny.model, prompt, [])
    effect = float((plain - expected).norm() / expected.norm())
    assert error < 0.2 * effect, (error, effect)  # int8 rounding, far below what the adapter changes


def test_adapters_span_and_head_read_only_their_modules(adapters_of: Any, tiny_model: GetTinyModel) -> None:
    one, _ = adapters_of("llama")
    loaded = load_span_adapters({"one": one.folder}, ["model.layers.2.", "model.layers.3."])
    assert sorted(loaded[0].pairs) == [
        f"model.layers.{b}.{m}" for b in (2, 3) for m in ("mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj")
    ]
    assert loaded[0].pairs["model.layers.2.self_attn.v_proj"].a.shape[0] == 2  # rank_pattern
    config = load_config(resolve_model(str(tiny_model("llama").folder)))
    head = load_head_adapters({"one": one.folder}, config)["one"]
    assert head.embed is not None and head.lm_head is not None


def test_unservable_adapters_are_refused(tiny_model: GetTinyModel, tmp_path: Path) -> None:
    mixtral = tiny_model("mixtral").model
    experts = make_adapter(mixtral, tmp_path / "experts", 3, r=2, target_modules=["q_proj"])
    config_path = experts.folder / "adapter_config.json"
    config_path.write_text(config_path.read_text().replace('"use_dora": false', '"use_dora": true'))
    with pytest.raises(ModelLoadError, match="use_dora"):
        load_span_adapters({"dora": experts.folder}, ["model.layers.0."])
    llama = tiny_model("llama").model
    norm = make_adapter(llama, tmp_path / "norm", 4, r=2, target_modules=["q_proj"], modules_to_save=["norm"])
    config = load_config(resolve_model(str(tiny_model("llama").folder)))
    with pytest.raises(ModelLoadError, match="model.norm"):
        load_head_adapters({"norm": norm.folder}, config)
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_adapter_specs(["nameless"])
    source = resolve_model(str(tiny_model("llama").folder))
    other_model = LoraAdapter(
        "other", {"model.layers.0.self_attn.q_proj": LoraPair(torch.zeros(2, 32), torch.zeros(64, 2), 1.0)}
    )
    with pytest.raises(ModelLoadError, match="maps 32 -> 64 features; the layer 64 -> 64"):
        build_span(config, open_weights(source, config), 0, 1, adapters=[other_model])
    rows = AdapterRows()
    rows.set(["a", None, "a"])
    assert {k: v.tolist() for k, v in rows.groups().items()} == {"a": [0, 2]}


def test_a_replaced_lm_head_is_the_adapters_own(tiny_model: GetTinyModel, tmp_path: Path) -> None:
    tiny = tiny_model("llama")
    saved = make_adapter(tiny.model, tmp_path / "saved", 5, r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with torch.no_grad():  # modules_to_save starts as a copy of the base head: make it differ, then save again
        for name, parameter in saved.model.named_parameters():
            if "modules_to_save" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
    saved.model.save_pretrained(saved.folder)
    swarm = Swarm(tiny.folder, {"saved": saved.folder}, cut=3)
    assert swarm.head.adapters["saved"].lm_head_weight is not None
    prompt = [3, 1, 4, 1, 5]
    rows = swarm.run([prompt, prompt], ["saved", None], 2)
    generated = [int(logits.argmax()) for logits in rows[0][len(prompt) - 1 : -1]]
    torch.testing.assert_close(torch.stack(rows[0]), reference(saved.model, prompt, generated), atol=ATOL, rtol=0)
    assert (torch.stack(rows[0][:5]) - torch.stack(rows[1][:5])).abs().max() > 0.1


def test_rows_equal_peft_merge_and_unload(tiny_model: GetTinyModel, adapters_of: Any) -> None:
    """The adapter merged into the weights (PEFT's merge_and_unload) gives what our unmerged per-row update gives."""
    tiny = tiny_model("llama")
    one, two = adapters_of("llama")
    swarm = Swarm(tiny.folder, {"one": one.folder, "two": two.folder}, cut=4)
    prompt = [9, 8, 7, 6, 5, 4]
    rows = swarm.run([prompt, prompt], ["two", "one"], 0)
    for row, adapter in enumerate((two, one)):
        merged = copy.deepcopy(adapter.model).merge_and_unload()
        torch.testing.assert_close(torch.stack(rows[row]), reference(merged, prompt, []), atol=ATOL, rtol=0)
