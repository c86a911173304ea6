"""The engine's speculative decode loop over an in-process chain of spans (tiny random models of every family).

The chain here is a seam: real span objects with real KV caches, stepped in this process instead of over P2P
(tests/integration/test_speculative_smollm2.py runs the same loop through real node processes). Checked: a verify
pass over k+1 positions gives step-by-step decode's logits; greedy output with speculation equals it without, for
every family, with drafts actually verified and some accepted; seeded sampling with penalties and logprobs gives the
same tokens with and without; and the acceptance rule keeps the model's distribution (a chi-square test over 20,000
samples of the first two tokens).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from gateway.generation import GeneratedToken, GenerationRequest, SamplingParams
from gateway.metrics import GatewayMetrics, current_metrics
from gateway.model.decode_loop import pick_token, verify_round
from gateway.model.engine import GenerationEngine
from gateway.model.files import load_tokenizer
from gateway.model.sampling import Sampler
from gateway.model.speculation import DecodePlan, PromptLookup, SpecTuner
from gateway.settings import EngineSettings
from shared.errors import PositionOutOfRange
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.backend import SpanBackend
from swarm_node.decode_batcher import BatchPolicy
from swarm_node.kv_cache import SessionKV, check_branch
from swarm_node.span import build_span
from tests.helpers.kept_chats import ended_chats, keeping_chats, plain_reference
from tests.helpers.processes import save_tiny_tokenizer
from tests.tiny_models import VOCAB, GetTinyModel, TinyModel
from tests.unit.swarm_node.test_span_exactness import Chain, build_chain, random_ids

ATOL = 1e-4
PROMPT = [5, 17, 99, 3, 42, 8, 1, 64, 2, 77, 5, 17, 99, 3, 42, 8]  # repeats itself: prompt lookup finds drafts
NEW_TOKENS = 40


class LocalChain:
    """What the engine needs of a ``ChainSession``, computed by span objects in this process."""

    def __init__(self, chain: Chain) -> None:
        self._chain = chain
        self._kvs: list[SessionKV] = chain.new_session()
        self.hops: list[object] = []
        self.steps: list[tuple[int, int]] = []  # (position, tokens) of every step
        self.truncated: list[int] = []
        self.trees: list[tuple[list[int] | None, list[int] | None]] = []  # (tree, branch) of every step
        self.closed = False

    async def step(
        self, hidden: torch.Tensor, position: int, tree: list[int] | None = None, branch: list[int] | None = None
    ) -> torch.Tensor:
        """A step as the nodes take it: ``branch`` keeps a tree step's branch first, ``tree`` lays out the tokens."""
        self.steps.append((position, hidden.shape[1]))
        self.trees.append((tree, branch))
        await asyncio.sleep(0)  # a remote step suspends the generation, as the nodes' round trip does
        if branch:
            self._keep(position, branch)
        with torch.inference_mode():
            for span, kv in zip(self._chain.spans, self._kvs, strict=True):
                hidden = span(hidden, [kv], [position], range(span.start, span.end), parents=tree)
            return hidden

    async def truncate(self, length: int, branch: list[int] | None = None) -> None:
        self.truncated.append(length)
        if branch:
            self._keep(length, branch)
        for kv in self._kvs:
            if length > kv.length:
                raise PositionOutOfRange(f"cannot truncate to {length}: {kv.length} held")
            kv.length = length

    def _keep(self, end: int, branch: list[int]) -> None:
        for kv in self._kvs:
            refusal = check_branch(kv.length, end - len(branch), branch)
            if refusal is not None:
                raise PositionOutOfRange(refusal)
            kv.keep_branch(end - len(branch), branch)

    @property
    def max_length(self) -> int:
        return self._kvs[0].max_length

    @property
    def lengths(self) -> set[int]:
        return {kv.length for kv in self._kvs}

    async def resize(self, max_length: int) -> None:
        for kv in self._kvs:
            kv.resize(max_length)  # refused below the stored tokens, as a node refuses

    async def close(self) -> None:
        self.closed = True


class OracleDrafts(PromptLookup):
    """Drafts from a known output, every fifth one wrong: rounds that keep every draft and rounds that reject one,
    whatever the random model generates (prompt lookup on a random model rarely finds repeats)."""

    def __init__(self, prompt_ids: list[int], tuner: SpecTuner, reference: list[int]) -> None:
        super().__init__(prompt_ids, tuner)
        self._emitted_from = len(prompt_ids)
        self._reference = reference

    def propose(self, k: int, after: Sequence[int] = (), forced: int = 0) -> list[int]:
        done = len(self.context) + len(after) - self._emitted_from
        drafts = self._reference[done : done + k]
        return [(t + 1) % VOCAB if (done + i) % 5 == 4 else t for i, t in enumerate(drafts)]


class LocalEngine(GenerationEngine):
    """The engine with its chain made in-process and a fixed route round trip."""

    rtt = 0.05

    def __init__(self, settings: EngineSettings, chain: Chain, oracle: list[int] | None = None) -> None:
        source = resolve_model(settings.model)
        super().__init__(settings, source, load_config(source), load_tokenizer(source, None), chain.head)
        self.local = chain
        self.chains: list[LocalChain] = []
        self._oracle = oracle

    def _drafter(self, request: GenerationRequest) -> PromptLookup | None:
        drafter = super()._drafter(request)
        if drafter is None or self._oracle is None:
            return drafter
        return OracleDrafts(request.prompt_ids, drafter.tuner, self._oracle)

    async def _prefill(self, request: GenerationRequest) -> tuple[LocalChain, torch.Tensor, int]:  # type: ignore[override]
        chain = LocalChain(self.local)
        self.chains.append(chain)
        return chain, await chain.step(self._embed(request.prompt_ids), 0), 0

    def _chain_rtts(self, chain: object) -> tuple[float, float]:  # type: ignore[override]
        return self.rtt, self.rtt


def pooled_chi_square_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """The chi-square p-value of ``counts`` against ``expected``, cells too small for the test pooled into one."""
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    wanted = wanted * observed.sum() / wanted.sum()  # float64 rounding: the totals must agree exactly
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


def local_engine(
    folder: Path, chain: Chain, speculative: str, oracle: list[int] | None = None, trees: bool = False
) -> LocalEngine:
    if not (folder / "tokenizer.json").exists():
        save_tiny_tokenizer(folder, VOCAB)
    settings = EngineSettings(
        model=str(folder), speculative=speculative, speculative_min_rtt=0.0, speculative_trees=trees
    )
    return LocalEngine(settings, chain, oracle)


async def run(engine: LocalEngine, request: GenerationRequest) -> list[GeneratedToken]:
    return [event async for event in engine.stream(request) if isinstance(event, GeneratedToken)]


@pytest.fixture
def tiny(tiny_model: GetTinyModel, tiny_variant: str) -> TinyModel:
    return tiny_model(tiny_variant)


def test_a_verify_pass_over_k_plus_1_positions_gives_step_by_step_logits(tiny: TinyModel) -> None:
    chain = build_chain(tiny.folder, (3,))
    prompt, tokens = random_ids(9, seed=5), random_ids(5, seed=6)
    stepwise, verify = chain.new_session(), chain.new_session()
    with torch.inference_mode():
        chain.step(prompt, stepwise, 0)
        chain.step(prompt, verify, 0)
        one_by_one = torch.cat([chain.step(tokens[:, i : i + 1], stepwise, 9 + i) for i in range(5)], dim=1)
        at_once = chain.step(tokens, verify, 9)
    torch.testing.assert_close(at_once, one_by_one, atol=ATOL, rtol=0)


async def test_greedy_with_speculation_equals_greedy_without(tiny: TinyModel) -> None:
    chain = build_chain(tiny.folder, (2, 4))
    metrics = GatewayMetrics()
    current_metrics.set(metrics)
    request = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0), logprobs=2)
    plain_engine = local_engine(tiny.folder, chain, "off")
    try:
        plain = await run(plain_engine, request)
        spec_engine = local_engine(tiny.folder, chain, "ngram", oracle=[t.token_id for t in plain])
        try:
            spec = await run(spec_engine, request)
        finally:
            await spec_engine.heads.close()
    finally:
        await plain_engine.heads.close()
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
    for got, want in zip(spec, plain, strict=True):  # the model's own logprobs, whichever step computed them
        assert got.logprob == pytest.approx(want.logprob, abs=ATOL)
        assert [i for i, _ in got.top] == [i for i, _ in want.top]
    drafted = metrics.spec_draft._value.get()
    accepted = metrics.spec_accepted._value.get()
    assert drafted > 0 and 0 < accepted < drafted  # drafts kept and drafts rejected (every fifth is wrong)
    assert max(tokens for _, tokens in spec_engine.chains[0].steps[1:]) > 1  # verify steps of several positions
    assert all(tokens == 1 for _, tokens in plain_engine.chains[0].steps[1:])


async def test_seeded_sampling_with_penalties_gives_the_same_tokens_with_and_without_speculation(
    tiny_model: GetTinyModel,
) -> None:
    tiny = tiny_model("llama")
    chain = build_chain(tiny.folder, (3,))
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=11, presence_penalty=0.3, repetition_penalty=1.1)
    request = GenerationRequest(PROMPT, NEW_TOKENS, params)
    metrics = GatewayMetrics()
    current_metrics.set(metrics)
    engines = [local_engine(tiny.folder, chain, "off")]
    try:
        plain = await run(engines[0], request)
        engines.append(local_engine(tiny.folder, chain, "ngram", oracle=[t.token_id for t in plain]))
        spec = await run(engines[1], request)
    finally:
        for engine in engines:
            await engine.heads.close()
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
    assert any(tokens > 1 for _, tokens in engines[1].chains[0].steps[1:])
    assert 0 < metrics.spec_accepted._value.get() < metrics.spec_draft._value.get()


class BatchedChain(LocalChain):
    """A chain whose steps run through real node backends (``SpanBackend``: decode batcher, packed forwards), so
    concurrent generations' decode and verify rows meet in the same forwards, as on nodes."""

    def __init__(self, chain: Chain, backends: list[SpanBackend]) -> None:
        super().__init__(chain)
        self._backends = backends
        self._kvs = [b.span.new_session_kv(range(b.span.start, b.span.end), 128) for b in backends]

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        decode = bool(self.steps)  # the prompt first; every later step is a row of a batch step
        self.steps.append((position, hidden.shape[1]))
        for backend, kv in zip(self._backends, self._kvs, strict=True):
            hidden = await backend.serve_step(kv, hidden, position, decode=decode)
        return hidden


class BatchedEngine(LocalEngine):
    """Generations over ``BatchedChain``s; drafts from each prompt's known output where one is given."""

    def __init__(self, settings: EngineSettings, chain: Chain, backends: list[SpanBackend]) -> None:
        super().__init__(settings, chain)
        self.backends = backends
        self.oracles: dict[tuple[int, ...], list[int]] = {}

    def _drafter(self, request: GenerationRequest) -> PromptLookup | None:
        drafter = GenerationEngine._drafter(self, request)
        reference = self.oracles.get(tuple(request.prompt_ids))
        if drafter is None or reference is None:
            return drafter
        return OracleDrafts(request.prompt_ids, drafter.tuner, reference)

    async def _prefill(self, request: GenerationRequest) -> tuple[LocalChain, torch.Tensor, int]:  # type: ignore[override]
        chain = BatchedChain(self.local, self.backends)
        self.chains.append(chain)
        return chain, await chain.step(self._embed(request.prompt_ids), 0), 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: sliding-window layers in the packed attention
async def test_generations_running_together_speculate_and_each_equals_plain_decoding(
    tiny_model: GetTinyModel, family: str
) -> None:
    """Several greedy streams at once on shared node backends, some speculating: their verify rows ride in the same
    batched forwards as the others' decode rows, and every stream's tokens equal plain decoding's alone."""
    tiny = tiny_model(family)
    chain = build_chain(tiny.folder, (3,))
    source = resolve_model(str(tiny.folder))
    config = load_config(source)
    reader = open_weights(source, config)
    backends = [SpanBackend(build_span(config, reader, a, b), BatchPolicy(window=0.05)) for a, b in ((0, 3), (3, 6))]
    prompts = [PROMPT, [int(t) for t in random_ids(11, seed=8)[0]], [int(t) for t in random_ids(7, seed=9)[0]]]
    requests = [GenerationRequest(p, 16, SamplingParams(temperature=0.0)) for p in prompts]
    if not (tiny.folder / "tokenizer.json").exists():
        save_tiny_tokenizer(tiny.folder, VOCAB)
    engines = []
    try:
        for speculative in ("off", "ngram"):
            settings = EngineSettings(model=str(tiny.folder), speculative=speculative, speculative_min_rtt=0.0)
            engines.append(BatchedEngine(settings, chain, backends))
        alone = [[t.token_id for t in await run(engines[0], request)] for request in requests]
        engines[1].oracles = {tuple(prompts[0]): alone[0], tuple(prompts[1]): alone[1]}  # the third: prompt lookup
        for backend in backends:
            backend.batcher.mixed = 0
        together = await asyncio.gather(*(run(engines[1], request) for request in requests))
    finally:
        for engine in engines:
            await engine.heads.close()
        for backend in backends:
            backend.shutdown()
    assert [[t.token_id for t in tokens] for tokens in together] == alone
    assert any(tokens > 1 for c in engines[1].chains for _, tokens in c.steps[1:])  # verify steps were sent
    assert all(backend.batcher.mixed > 0 for backend in backends)  # ... in forwards with rows of other lengths


def test_the_acceptance_rule_keeps_the_models_distribution(tiny_model: GetTinyModel) -> None:
    """First token x ~ p0; when x equals the draft d, the second token ~ p1(. | d) from the same verify pass, with
    d counted by the penalties. 20,000 seeded rounds against those exact probabilities (chi-square)."""
    tiny = tiny_model("llama")
    chain = build_chain(tiny.folder, (3,))
    engine = local_engine(tiny.folder, chain, "ngram")
    TEMPERATURE = 0.5  # noqa: N806
    prompt = PROMPT[:8]
    with torch.inference_mode():
        logits = chain.step(torch.tensor([prompt]), chain.new_session(), 0)[0, -1:]  # [1, V] after the prompt
        p0 = torch.softmax(logits[0] / TEMPERATURE, dim=-1)
        draft = int(p0.argmax())
        both = chain.step(torch.tensor([[*prompt, draft]]), chain.new_session(), 0)[0, -2:]  # [2, V]
    params = SamplingParams(temperature=TEMPERATURE, presence_penalty=0.8)
    p0 = torch.softmax(both[0] / TEMPERATURE, dim=-1).double()
    p1 = torch.softmax((both[1] - 0.8 * (torch.arange(VOCAB) == draft)) / TEMPERATURE, dim=-1).double()
    assert 0.1 < float(p0[draft]) < 0.9  # both branches of the rule get exercised
    request = GenerationRequest(prompt, 10, params)
    counts = torch.zeros(2, VOCAB, dtype=torch.float64)  # [first token (not the draft) | second token after it]
    for seed in range(20_000):
        sampler = Sampler(params.with_seed(seed), VOCAB, prompt)
        pick = functools.partial(pick_token, sampler=sampler, stop_ids=engine.stop_ids, num_logprobs=None)
        tokens = verify_round(both, [draft], pick, DecodePlan(request, None), 0, engine._embed).tokens
        if tokens[0].token_id != draft:
            assert len(tokens) == 1
            counts[0, tokens[0].token_id] += 1
        else:
            counts[1, tokens[1].token_id] += 1
    expected = torch.stack([p0 * (torch.arange(VOCAB) != draft), p0[draft] * p1]) * 20_000
    assert pooled_chi_square_pvalue(counts, expected) > 1e-3


async def test_a_kept_conversation_is_rolled_back_to_its_tokens_before_it_shrinks(tiny_model: GetTinyModel) -> None:
    """A chat kept for its next turn must hold exactly its tokens: drafts rejected in its last round are truncated
    away (else the shrink to its tokens would be refused and the conversation lost)."""
    tiny = tiny_model("llama")
    chain = build_chain(tiny.folder, (3,))
    plain_engine = local_engine(tiny.folder, chain, "off")
    reference = await plain_reference(plain_engine, PROMPT, 30)
    async with keeping_chats(local_engine(tiny.folder, chain, "ngram", oracle=reference)) as engine:
        async for chat in ended_chats(engine, PROMPT, reference):  # the drafts after the end-of-sequence token go
            held = len(chat.kept.token_ids)  # every token but the last (never fed), or all of them (fed as a draft)
            assert held in (len(PROMPT) + len(chat.expected) - 1, len(PROMPT) + len(chat.expected))
            assert chat.chain.lengths == {held} and chat.chain.max_length == held and not chat.chain.closed
        assert any(local.truncated for local in engine.chains)
