"""``--speculative draft``: a small model at the gateway drafts greedily, its cache cropped to what the chain kept.

Two tiny random llamas share a tokenizer (the served 6-layer one and a 2-layer draft); the served model drafting for
itself gets every draft accepted. The engine runs over the in-process chain of test_speculative_engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

from gateway.generation import GenerationRequest, SamplingParams
from gateway.metrics import GatewayMetrics, current_metrics
from gateway.model.draft_model import DraftModel
from gateway.model.files import load_tokenizer
from gateway.model.speculation import SpecTuner
from gateway.settings import EngineSettings
from shared.errors import ModelLoadError
from shared.model_source import resolve_model
from tests.helpers.model_loads import record_model_loads
from tests.helpers.processes import save_tiny_tokenizer
from tests.tiny_models import VOCAB, GetTinyModel, TinyModel
from tests.unit.gateway.model.test_speculative_engine import PROMPT, LocalEngine, run
from tests.unit.swarm_node.test_span_exactness import build_chain


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random llama over the same vocabulary and tokenizer as the tiny models."""
    torch.manual_seed(42)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    folder = tmp_path_factory.mktemp("draft-llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    save_tiny_tokenizer(folder, VOCAB)
    return folder


@pytest.fixture
def llama(tiny_model: GetTinyModel) -> TinyModel:
    tiny = tiny_model("llama")
    if not (tiny.folder / "tokenizer.json").exists():
        save_tiny_tokenizer(tiny.folder, VOCAB)
    return tiny


def greedy(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)  # type: ignore[operator]
    return [int(t) for t in output[0, len(prompt) :]]


def test_drafts_are_the_draft_models_greedy_tokens_also_after_a_rejection(llama: TinyModel, draft_folder: Path) -> None:
    draft = DraftModel.load(str(draft_folder), _tokenizer(llama))
    session = draft.session(PROMPT, SpecTuner(k_max=8, min_rtt=0.0))
    assert session.propose(5) == greedy(draft.model, PROMPT, 5)
    # the chain kept the first two drafts and then emitted another token: the cache is cropped, not rebuilt
    kept = session.propose(5)[:2]
    for token in [*kept, (kept[-1] + 1) % VOCAB]:
        session.emitted(token)
    assert session.propose(4) == greedy(draft.model, session.context, 4)


def test_only_the_read_into_an_empty_cache_is_left_out_of_the_draft_cost(llama: TinyModel, draft_folder: Path) -> None:
    draft = DraftModel.load(str(draft_folder), _tokenizer(llama))
    session = draft.session(PROMPT * 8, SpecTuner(k_max=8, min_rtt=0.0))
    drafts = session.propose(3)
    assert session.unpriced > 0.0  # the prompt's read: once per generation, not per drafted token
    session.emitted(drafts[0])
    session.propose(3)
    assert session.unpriced == 0.0  # later rounds read only the tokens emitted since: a cost of drafting


def test_tokens_emitted_while_nothing_was_drafted_are_read_apart_from_the_drafting(
    llama: TinyModel, draft_folder: Path
) -> None:
    draft = DraftModel.load(str(draft_folder), _tokenizer(llama))
    session = draft.session(PROMPT, SpecTuner(k_max=8, min_rtt=0.0))
    for token in session.propose(2)[:1] + [3, 5, 7, 9, 11]:  # k = 0 for some rounds: six tokens the cache lacks
        session.emitted(token)
    drafts = session.propose(3)
    # the tuner's probe after k = 0 rounds: its one-draft price must not carry the catch-up's read
    assert session.unpriced > 0.0
    assert drafts == greedy(draft.model, session.context, 3)  # the split read drafts the same tokens


@pytest.mark.slow
def test_a_gguf_draft_models_tokenizer_is_read_from_the_config_cache(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama: TinyModel
) -> None:
    """A GGUF draft's tokenizer (read only to compare it with the served one) comes from the config cache the
    gateway's own start filled, not from a conversion at every start."""
    served = load_tokenizer(resolve_model(str(smollm2_gguf)), cache_dir=tmp_path)  # the gateway's start
    # its weights are not what this test reads: a tiny model, not 135M dequantized
    loads = record_model_loads(monkeypatch, {"the draft model": llama.model})
    DraftModel.load(str(smollm2_gguf), served, tmp_path)
    assert loads == ["the draft model"]  # its weights only: the tokenizer was read back, not converted


def test_a_draft_model_with_another_tokenizer_is_refused_at_start(llama: TinyModel, tmp_path: Path) -> None:
    other = tmp_path / "other"
    AutoModelForCausalLM.from_config(llama.model.config).save_pretrained(other)
    save_tiny_tokenizer(other, VOCAB - 1)
    with pytest.raises(ModelLoadError, match="another tokenizer"):
        DraftModel.load(str(other), _tokenizer(llama))
    with pytest.raises(ValidationError, match="--draft-model"):
        EngineSettings(model=str(llama.folder), speculative="draft")
    with pytest.raises(ValidationError, match="--draft-model"):
        EngineSettings(model=str(llama.folder), draft_model=str(other))


@pytest.mark.parametrize("drafter", ["itself", "small"])
async def test_greedy_with_a_draft_model_equals_greedy_without(
    llama: TinyModel, draft_folder: Path, drafter: str
) -> None:
    chain = build_chain(llama.folder, (3,))
    metrics = GatewayMetrics()
    current_metrics.set(metrics)
    request = GenerationRequest(PROMPT, 30, SamplingParams(temperature=0.0), logprobs=1)
    folder = llama.folder if drafter == "itself" else draft_folder
    plain_settings = EngineSettings(model=str(llama.folder), speculative="off")
    spec_settings = EngineSettings(
        model=str(llama.folder), speculative="draft", draft_model=str(folder), speculative_min_rtt=0.0
    )
    engines = [LocalEngine(plain_settings, chain), LocalEngine(spec_settings, chain)]
    engines[1].draft_model = DraftModel.load(str(folder), engines[1].tokenizer)
    try:
        plain, spec = [await run(engine, request) for engine in engines]
    finally:
        for engine in engines:
            await engine.heads.close()
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
    drafted, accepted = metrics.spec_draft._value.get(), metrics.spec_accepted._value.get()
    assert drafted > 0
    if drafter == "itself":
        assert accepted == drafted  # the served model agrees with itself
        assert len(engines[1].chains[0].steps) < len(engines[0].chains[0].steps) / 2  # fewer round trips
    else:
        assert accepted < drafted


def _tokenizer(tiny: TinyModel) -> PreTrainedTokenizerBase:
    return load_tokenizer(resolve_model(str(tiny.folder)))
