"""The grammar's forced tokens as speculative drafts (``Constraint.forced``), over an in-process chain: a tiny random
llama with SmolLM2's real tokenizer (49,152 tokens), so llguidance compiles real JSON schemas against it.

Checked: greedy output with forced drafts equals greedy without, logprobs included, while steps of several positions
carry them and the random model both keeps and rejects them (it spells forced bytes otherwise now and then); seeded
sampling gives the same tokens; and the acceptance rule keeps the masked distribution (chi-square over the first two
tokens of a JSON object, the second drawn after a forced draft from the same verify pass).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerBase

from gateway.generation import GeneratedToken, GenerationRequest, Grammar, SamplingParams
from gateway.metrics import GatewayMetrics, current_metrics
from gateway.model.decode_loop import pick_token, verify_round
from gateway.model.grammar import Constraint, GrammarCompiler
from gateway.model.sampling import Sampler
from gateway.model.spec_tuner import SpecTuner
from gateway.model.speculation import DecodePlan
from gateway.model.suffix_drafts import SuffixDrafts
from gateway.model.tokens import word_ids
from tests.helpers.smollm2 import load_tokenizer
from tests.tiny_models import _COMMON
from tests.unit.gateway.model.test_speculative_engine import LocalEngine, local_engine, run
from tests.unit.swarm_node.test_span_exactness import build_chain

V = 49152
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "email", "age"],
    "additionalProperties": False,
}
GRAMMAR = Grammar("json_schema", json.dumps(SCHEMA))
PROMPT = [1, 504, 2503, 314, 253, 1378, 28, 2]


@pytest.fixture(scope="module")
def folder(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama whose vocabulary is SmolLM2's, saved with SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("tiny-smol-vocab")
    torch.manual_seed(3)
    config = LlamaConfig(**{**_COMMON, "vocab_size": V, "initializer_range": 0.05}, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(path)
    load_tokenizer(smollm2_gguf).save_pretrained(path)
    return path


async def _both(
    folder: Path, request: GenerationRequest
) -> tuple[list[GeneratedToken], list[GeneratedToken], LocalEngine]:
    """The request without speculation, then with it (forced drafts on): both outputs and the second engine."""
    chain = build_chain(folder, (3,))
    engines = [local_engine(folder, chain, "off"), local_engine(folder, chain, "ngram")]
    try:
        return await run(engines[0], request), await run(engines[1], request), engines[1]
    finally:
        for engine in engines:
            await engine.heads.close()
            if engine._grammars is not None:
                engine._grammars.close()


async def test_greedy_with_forced_drafts_equals_greedy_without(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SuffixDrafts, "propose", lambda self, k, after=(), forced=0: [])  # only forced drafts
    metrics = GatewayMetrics()
    current_metrics.set(metrics)
    request = GenerationRequest(PROMPT, 48, SamplingParams(temperature=0.0), logprobs=2, grammar=GRAMMAR)
    plain, spec, engine = await _both(folder, request)
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
    for got, want in zip(spec, plain, strict=True):  # forced tokens' logprobs come from their verify pass
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [i for i, _ in got.top] == [i for i, _ in want.top]
    assert max(tokens for _, tokens in engine.chains[0].steps[1:]) > 1  # forced tokens rode as drafts
    assert metrics.spec_accepted._value.get() > 0


async def test_greedy_with_drafts_the_grammar_checks_and_extends_equals_greedy_without(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every round the drafter offers a value's end (``x",``): the grammar cuts it where it is not allowed, and
    where it is, asks what it forces after it (the next key) and rolls back; greedy output is unchanged."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    offered = tokenizer.encode('x",')
    asked: list[int] = []
    forced_after = Constraint.forced_after

    def counted(self: Constraint, drafts: Sequence[int]) -> list[int]:
        more = forced_after(self, drafts)
        asked.append(len(more))
        return more

    monkeypatch.setattr(SuffixDrafts, "propose", lambda self, k, after=(), forced=0: offered[:k])
    monkeypatch.setattr(Constraint, "forced_after", counted)
    request = GenerationRequest(PROMPT, 48, SamplingParams(temperature=0.0), grammar=GRAMMAR)
    plain, spec, engine = await _both(folder, request)
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
    assert max(asked) > 0  # a step carried forced tokens after the drafts


async def test_seeded_sampling_with_forced_drafts_gives_the_same_tokens(folder: Path) -> None:
    params = SamplingParams(temperature=0.8, seed=5, frequency_penalty=0.2)
    request = GenerationRequest(PROMPT, 48, params, grammar=GRAMMAR)
    plain, spec, engine = await _both(folder, request)
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
    assert max(tokens for _, tokens in engine.chains[0].steps[1:]) > 1


def test_forced_drafts_keep_the_masked_distribution(folder: Path) -> None:
    """The grammar forces ``{"name":"`` first, spelled ``{"`` ``name`` ``":"``: the first two are the only tokens
    the mask allows, but after them the mask allows ``"``, ``":`` and ``":"``. With ``{"name`` emitted and ``":"``
    drafted: x0 ~ p0 under the mask; when x0 is the draft, x1 ~ p1 under the mask after it, from the same verify
    pass. 2,000 seeded rounds against those exact probabilities (chi-square)."""
    chain = build_chain(folder, (3,))
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(str(folder)), V, [2])

    template = compiler.constraint(GRAMMAR)
    head = template.forced()  # waits for the first mask, which holds the matcher
    template.advance(head[0])
    template.advance(head[1])

    def after_name() -> Constraint:  # a fresh constraint that has taken ``{"`` and ``name``
        return Constraint(template._matcher.deep_copy(), V, compiler._pool, compiler._tokenizer)

    def embed(token_ids: list[int]) -> torch.Tensor:
        return chain.head.embed(torch.tensor([token_ids]))

    try:
        forced = compiler.constraint(GRAMMAR).forced()
        assert len(forced) == 3
        draft = forced[2]
        with torch.inference_mode():
            hidden = chain.forward(embed([*PROMPT, *forced]), [chain.new_session()], [0])
            logits = chain.head.logits(hidden)[0, -2:]  # [2, V]: after ``name``, after ``":"``
        temperature, samples = 2.0, 2000  # hot: the model's other spellings get mass
        first, second = after_name(), after_name()
        p0 = torch.softmax(first.apply(logits[0]) / temperature, -1).double()
        second.advance(draft)
        p1 = torch.softmax(second.apply(logits[1]) / temperature, -1).double()
        assert 0.05 < float(p0[draft]) < 0.95  # both branches of the rule get exercised
        params = SamplingParams(temperature=temperature)
        request = GenerationRequest(PROMPT, 10, params)
        counts = torch.zeros(2, V, dtype=torch.float64)
        for seed in range(samples):
            sampler = Sampler(params.with_seed(seed), V, PROMPT, after_name())
            pick = functools.partial(pick_token, sampler=sampler, stop_ids={2}, num_logprobs=None)
            tokens = verify_round(logits, [draft], pick, DecodePlan(request, None), 0, embed).tokens
            if tokens[0].token_id != draft:
                assert len(tokens) == 1
                counts[0, tokens[0].token_id] += 1
            else:
                counts[1, tokens[1].token_id] += 1
    finally:
        compiler.close()
    expected = torch.stack([p0 * (torch.arange(V) != draft), p0[draft] * p1]) * samples
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    wanted = wanted * observed.sum() / wanted.sum()
    assert float(chisquare(observed.numpy(), wanted.numpy()).pvalue) > 1e-3


def test_forced_bytes_are_spelled_as_the_model_spelled_them(folder: Path) -> None:
    """After ``{"name`` the grammar forces ``":"``, llguidance's one canonical token. A model that writes ``":``
    then ``"`` (SmolLM2 does under a compact grammar) taught the constraint so: the next forced bytes come in its
    spelling, while a choice that is not a shorter spelling of the same bytes teaches nothing."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    compiler = GrammarCompiler(tokenizer, V, [2])
    whole, colon, quote = (tokenizer.convert_tokens_to_ids(t) for t in ('":"', '":', '"'))
    try:
        constraint = compiler.constraint(GRAMMAR)
        opening, name, canonical = constraint.forced()
        assert canonical == whole
        constraint.respell(whole, tokenizer.convert_tokens_to_ids("name"))  # not the start of ``":"``: ignored
        constraint.advance(opening)
        constraint.advance(name)
        assert constraint.forced() == [whole]
        constraint.respell(whole, colon)
        assert constraint.forced() == [colon, quote]
        constraint.advance(colon)
        assert constraint.forced() == [quote]
    finally:
        compiler.close()


class RecordedSpellings:
    """A grammar that forces the same three tokens each round, allows every draft and records what ``respell`` and
    ``respell_draft`` are told."""

    def __init__(self) -> None:
        self.respelled: list[tuple[int, int]] = []
        self.respelled_drafts: list[tuple[int, int]] = []

    def forced(self) -> list[int]:
        return [7, 8, 9]

    def forced_after(self, drafts: Sequence[int]) -> list[int]:
        return []

    def allowed_drafts(self, before: Sequence[int], drafts: Sequence[int]) -> list[int]:
        return list(drafts)

    def respell(self, drafted: int, chosen: int) -> None:
        self.respelled.append((drafted, chosen))

    def respell_draft(self, drafted: int, chosen: int) -> None:
        self.respelled_drafts.append((drafted, chosen))


@pytest.mark.parametrize(
    ("accepted", "told", "told_drafts"),
    [(4, [], []), (3, [], [(5, 42)]), (1, [(8, 42)], []), (0, [(7, 42)], [])],
)
def test_the_plan_tells_the_grammar_which_draft_the_model_spelled_otherwise(
    accepted: int, told: list[tuple[int, int]], told_drafts: list[tuple[int, int]]
) -> None:
    """Forced drafts and the drafter's are told apart: each kind has its own respelling rule."""
    grammar = RecordedSpellings()
    plan = DecodePlan(GenerationRequest(PROMPT, 40), SuffixDrafts(PROMPT, SpecTuner(k_max=4, min_rtt=0.0)), grammar)
    plan.next_k(rtt=0.2, others=0)  # a far chain: forcing pays
    drafts, forced = plan.propose(0)
    assert (drafts, forced) == ([7, 8, 9], 3)
    drafts.append(5)  # as if the drafter had drafted one more
    emitted = [GeneratedToken(token, False) for token in drafts[:accepted]] + [GeneratedToken(42, False)]
    plan.kept(drafts, forced, accepted, emitted)
    assert (grammar.respelled, grammar.respelled_drafts) == (told, told_drafts)


def _advanced(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, grammar: Grammar, text: str) -> Constraint:
    """A constraint that took ``text``'s tokens as the sampler gives them: each after its mask."""
    constraint = compiler.constraint(grammar)
    for token in tokenizer.encode(text):
        assert constraint.apply(torch.zeros(V))[token] == 0
        constraint.advance(token)
    return constraint


def test_the_grammar_says_what_it_forces_after_drafts_and_stays_where_it_was(folder: Path) -> None:
    """A drafted value's end (``",``) is followed by the next key, forced: asked after the drafts, the matcher takes
    them, answers, and is rolled back to the text emitted."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    compiler = GrammarCompiler(tokenizer, V, [2])
    try:
        constraint = _advanced(compiler, tokenizer, GRAMMAR, '{"name":"')
        maria, close = tokenizer.encode("Maria"), tokenizer.convert_tokens_to_ids('",')
        assert tokenizer.decode(constraint.forced_after([*maria, close])) == '"email":"'
        assert constraint.forced_after(maria) == []  # inside the string: nothing is forced
        assert constraint.forced() == []  # still right after ``"name":"``
        assert constraint.forced_after([tokenizer.convert_tokens_to_ids("}")]) == []  # not taken: nothing
        constraint.advance(maria[0])
        assert tokenizer.decode(constraint.forced_after([*maria[1:], close])) == '"email":"'
    finally:
        compiler.close()


def test_drafts_the_grammar_forbids_are_cut_and_a_closing_quote_is_learned(folder: Path) -> None:
    """Digits are drafted into an integer up to the first letter; a value copied up to the prompt's comma, which the
    model wrote as ``",``, drafts ``",`` where the drafter has ``,`` from then on, until the model writes ``,``."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    compiler = GrammarCompiler(tokenizer, V, [2])
    one, eight, word = tokenizer.convert_tokens_to_ids(["1", "8", "years"])
    comma, closing = tokenizer.convert_tokens_to_ids([",", '",'])
    try:
        age = _advanced(compiler, tokenizer, GRAMMAR, '{"name":"M","email":"m","age":')
        assert age.allowed_drafts([], [one, eight, word, one]) == [one, eight]
        assert age.allowed_drafts([one], [eight, word]) == [eight]
        name = _advanced(compiler, tokenizer, GRAMMAR, '{"name":"Maria')
        assert name.allowed_drafts([], [comma]) == [comma]
        name.respell_draft(comma, closing)
        assert name.allowed_drafts([], [comma, one]) == [closing]  # then a key's quote, not a digit
        name.respell_draft(closing, comma)  # a comma inside a value after all
        assert name.allowed_drafts([], [comma]) == [comma]
        name.respell_draft(one, tokenizer.convert_tokens_to_ids("Maria"))  # not the same bytes: nothing learned
        assert name.allowed_drafts([], [one]) == [one]
    finally:
        compiler.close()


def test_once_a_copied_value_ended_at_a_comma_other_marks_that_end_a_phrase_end_it_too(folder: Path) -> None:
    """The model closed a value at the prompt's comma with ``",``: a ``)`` or a `` (`` is drafted as ``",`` too,
    and a dot before a space, while a mark inside a word (``example.com``'s dot) stays; a mark written where ``",``
    was drafted unlearns it."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    compiler = GrammarCompiler(tokenizer, V, [2])
    comma, closing, paren, lives, dot, com, opening = tokenizer.convert_tokens_to_ids(
        [",", '",', ")", "Ġlives", ".", "com", "Ġ("]
    )
    try:
        name = _advanced(compiler, tokenizer, GRAMMAR, '{"name":"Maria')
        assert name.allowed_drafts([], [paren, lives]) == [paren, lives]  # nothing learned yet
        name.respell_draft(comma, closing)
        assert name.allowed_drafts([], [paren, lives]) == [closing]  # then a key's quote, not `` lives``
        assert name.allowed_drafts([], [opening]) == [closing]
        assert name.allowed_drafts([], [dot, com]) == [dot, com]
        assert name.allowed_drafts([], [dot]) == [dot]  # the last draft: no sign the phrase ends
        assert name.allowed_drafts([], [dot, lives]) == [closing]
        assert name.allowed_drafts([], [paren]) == [closing]  # a bracket ends it wherever it stands
        name.respell_draft(closing, paren)  # the model wrote ``)`` inside the value
        assert name.allowed_drafts([], [paren, lives]) == [paren, lives]
        assert name.allowed_drafts([], [comma]) == [closing]  # a comma's own spelling stands
    finally:
        compiler.close()


def test_a_copied_value_its_close_and_the_next_key_travel_in_one_step(folder: Path) -> None:
    """The structured workload's loss: ``Val`` emitted, the prompt has `` Valencia, Spain``; once the model was seen
    closing a copied value at the prompt's comma, one step drafts the value's rest, ``",``, and the next key."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    compiler = GrammarCompiler(tokenizer, V, [2])
    try:
        constraint = _advanced(compiler, tokenizer, Grammar("json_schema", json.dumps(schema)), '{"city":"Val')
        prompt = tokenizer.encode("Extract the address as JSON: she lives in Valencia, Spain, near the sea.")
        output = tokenizer.encode('{"city":"Val')
        drafter = SuffixDrafts([*prompt, *output], SpecTuner(k_max=8, min_rtt=0.0), words=word_ids(tokenizer))
        plan = DecodePlan(GenerationRequest(prompt, 40), drafter, constraint)
        plan.next_k(rtt=0.2, others=0)  # a far chain: forcing pays
        assert tokenizer.decode(plan.propose(8)[0]) == "encia, Spain, near the sea."  # the prompt's text, on
        comma, closing = tokenizer.convert_tokens_to_ids([",", '",'])
        plan.kept([comma], 0, 0, [GeneratedToken(closing, False)])  # seen once: the model closes the value there
        drafts, forced = plan.propose(8)
        assert (tokenizer.decode(drafts), forced) == ('encia","country":"', 0)
    finally:
        compiler.close()


def test_a_name_copied_from_the_prompt_into_a_json_string_is_drafted(folder: Path) -> None:
    """SmolLM2's vocabulary spells `` Maria`` and ``Maria`` as two tokens: the value's first word (after ``"``) is
    matched to the prompt's as a word, and its continuation drafted from there."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    words = word_ids(tokenizer)
    spaced, bare = tokenizer.convert_tokens_to_ids(["ĠMaria", "Maria"])
    assert words[spaced] == bare and words[bare] == bare
    prompt = tokenizer.encode("Extract the customer as JSON: Maria Lopez (maria@example.com) lives in Oslo.")
    output = tokenizer.encode('{"name":"Maria')
    assert output[-1] == bare
    drafter = SuffixDrafts([*prompt, *output], SpecTuner(k_max=4, min_rtt=0.0), words=words)
    assert tokenizer.decode(drafter.propose(1)) == " Lopez"
    assert SuffixDrafts([*prompt, *output], SpecTuner(k_max=4, min_rtt=0.0)).propose(1) == []
