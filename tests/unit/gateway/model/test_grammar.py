"""Constrained decoding against SmolLM2's real tokenizer: the sampler, fed random logits, only ever writes text the
grammar allows — 200 random JSON schemas, every output parses and validates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from gateway.generation import GeneratedToken, GenerationRequest, Grammar, InvalidGrammar, SamplingParams
from gateway.model.grammar import GrammarCompiler
from gateway.model.sampling import Sampler
from gateway.model.speculation import DecodePlan, verify_drafts
from tests.helpers.smollm2 import load_tokenizer

EOS = 2  # <|im_end|>
V = 49152


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    compiled = GrammarCompiler(tokenizer, V, [EOS])
    yield compiled
    compiled.close()


_CLOSERS: dict[int, torch.Tensor] = {}


def _closers(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Tokens that end things (quotes, closing brackets, short values, EOS): a random 'model' that favours them
    finishes its JSON. No opening brackets: favoured, they nest free objects without end."""
    if id(tokenizer) not in _CLOSERS:
        wanted = {'"', "}", "]", ",", ":", "0", "1", "true", "null"}
        vocab = tokenizer.get_vocab()
        _CLOSERS[id(tokenizer)] = torch.tensor([vocab[token] for token in wanted if token in vocab] + [EOS])
    return _CLOSERS[id(tokenizer)]


def generate(
    compiler: GrammarCompiler,
    grammar: Grammar,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    temperature: float = 1.0,
    budget: int = 400,
) -> str:
    """Sample up to EOS with random logits [V] through the real sampler + constraint; the text without EOS."""
    constraint = compiler.constraint(grammar)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed), V, [], constraint)
    noise = torch.Generator().manual_seed(seed)
    closers = _closers(tokenizer)
    tokens: list[int] = []
    for _ in range(budget):
        # Closers carry most of the mass (a dozen at e^12 against 49k at E[e^2z] = e^2): strings and arrays end.
        logits = torch.randn(V, generator=noise) * 2
        logits[closers] += 12.0
        token = sampler.next_token(logits)
        if token == EOS:
            return str(tokenizer.decode(tokens))
        tokens.append(token)
    raise AssertionError(f"no EOS within {budget} tokens: {tokenizer.decode(tokens)!r}")


def test_a_schema_with_bounds_patterns_and_refs_gives_valid_json(compiler: GrammarCompiler, tokenizer: Any) -> None:
    schema = {
        "$defs": {"tag": {"type": "string", "pattern": "^[a-z]{2,5}$"}},
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
            "kind": {"enum": ["cat", "dog"]},
        },
        "required": ["age", "tags", "kind"],
        "additionalProperties": False,
    }
    validator = jsonschema_rs.validator_for(schema)
    for seed in range(5):
        text = generate(compiler, Grammar("json_schema", json.dumps(schema)), tokenizer, seed)
        validator.validate(json.loads(text))


def test_greedy_follows_the_grammar_even_when_the_model_wants_something_else(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    text = generate(compiler, Grammar("regex", "(yes|no)"), tokenizer, seed=0, temperature=0.0)
    assert text in ("yes", "no")


def test_a_lark_grammar_embeds_a_schema(compiler: GrammarCompiler, tokenizer: Any) -> None:
    lark = 'start: "<tool_call>" call "</tool_call>"\ncall: %json {"type": "object", "required": ["name"]}'
    text = generate(compiler, Grammar("lark", lark), tokenizer, seed=3)
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    assert "name" in json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))


def test_a_grammar_that_does_not_compile_is_a_typed_error(compiler: GrammarCompiler) -> None:
    with pytest.raises(InvalidGrammar) as caught:
        compiler.constraint(Grammar("lark", "start: undefined_rule", param="tools"))
    assert caught.value.param == "tools"
    with pytest.raises(InvalidGrammar):
        compiler.constraint(Grammar("json_schema", "{not json"))


def test_the_mask_leaves_allowed_logits_untouched(compiler: GrammarCompiler) -> None:
    """Constraint.apply only writes -inf: the allowed tokens keep the model's values (logprobs come from the raw
    logits anyway, before the sampler sees them)."""
    constraint = compiler.constraint(Grammar("regex", "[0-9]+"))
    logits = torch.randn(V)
    masked = constraint.apply(logits)
    allowed = torch.isfinite(masked)
    assert 0 < int(allowed.sum()) < V
    assert torch.equal(masked[allowed], logits[allowed])
    assert torch.isfinite(logits).all()  # the caller's tensor is not modified


# Random JSON schemas: scalars with bounds, enums, patterns; objects with required keys; arrays; anyOf.
_scalar = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 500),
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.sampled_from([{"type": "string", "pattern": "^[a-z]+$"}, {"type": "string", "format": "date"}]),
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}
    ),
)


def _compound(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=6), children, min_size=1, max_size=4).flatmap(
        lambda props: st.builds(
            lambda required, closed: {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": not closed,
            },
            st.lists(st.sampled_from(sorted(props)), unique=True),
            st.booleans(),
        )
    )
    arrays = st.builds(
        lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra},
        children,
        st.integers(0, 2),
        st.integers(0, 3),
    )
    unions = st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
    return st.one_of(objects, arrays, unions)


schemas = st.recursive(_scalar, _compound, max_leaves=8)


@pytest.mark.timeout(1800)  # about a minute alone; the 2-core box is often shared by many test runs
# derandomize: the same 200 schemas every run, so a run fails only when the code changed.
@settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=schemas, seed=st.integers(0, 2**31))
def test_random_schemas_give_valid_json_at_temperature_one(
    compiler: GrammarCompiler, tokenizer: Any, schema: dict[str, Any], seed: int
) -> None:
    text = generate(compiler, Grammar("json_schema", json.dumps(schema)), tokenizer, seed)
    jsonschema_rs.validator_for(schema).validate(json.loads(text))


def test_speculative_rounds_under_a_grammar_emit_what_step_by_step_sampling_emits(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Drafts are verified through the grammar mask: the constraint advances over emitted tokens only, so rounds of
    drafts (some wrong, some the grammar forbids) give exactly the tokens of step-by-step sampling, valid JSON."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    grammar = Grammar("json_schema", json.dumps(schema))
    noise = torch.Generator().manual_seed(5)
    rows = torch.randn(200, V, generator=noise) * 2  # a "model" whose logits at output position n are rows[n]
    rows[:, _closers(tokenizer)] += 12.0
    params = SamplingParams(temperature=0.8, seed=9)

    plain_sampler = Sampler(params, V, [], compiler.constraint(grammar))
    plain: list[int] = []
    while not plain or plain[-1] != EOS:
        plain.append(plain_sampler.next_token(rows[len(plain)]))

    sampler = Sampler(params, V, [], compiler.constraint(grammar))
    plan = DecodePlan(GenerationRequest([1], len(plain) + 50), None)

    def pick(row: torch.Tensor) -> GeneratedToken:
        token = sampler.next_token(row)
        return GeneratedToken(token, token == EOS)

    spec: list[int] = []
    rounds = 0
    while not plan.done:
        n = len(spec)
        # the next four tokens as drafts, every third one replaced by a token the grammar never allows here ("{")
        drafts = [tokenizer.get_vocab()["{"] if (n + i) % 3 == 2 else t for i, t in enumerate(plain[n : n + 4])]
        tokens, _ = verify_drafts(rows[n : n + len(drafts) + 1], drafts, pick, plan)
        spec += [t.token_id for t in tokens]
        rounds += 1
    assert spec == plain and rounds < len(plain)
    json.loads(tokenizer.decode(spec[:-1]))
