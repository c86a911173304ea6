"""Tree speculation through the engine's decode loop over an in-process chain of spans (``LocalChain``: real spans,
real KV caches, the nodes' tree steps and kept branches).

Checked: greedy output with tree drafts equals plain decoding (families with rotary, sliding windows, soft-capping
and ALiBi), with trees verified and branches other than the first kept; seeded sampling with penalties gives the
same tokens; the walk keeps the model's distribution over a tree of two branches (chi-square); a kept conversation
holds exactly its tokens' keys and values after a tree round; and the plan's pure parts (chances, pruning, size).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
import torch

from gateway.generation import GeneratedToken, GenerationRequest, SamplingParams
from gateway.metrics import GatewayMetrics, current_metrics
from gateway.model.decode_loop import pick_token, verify_round
from gateway.model.sampling import Sampler
from gateway.model.speculation import (
    DecodePlan,
    DraftTree,
    PromptLookup,
    ScoredTree,
    SpecTuner,
    choose_k,
    choose_tree,
    node_chances,
    prune_tree,
)
from gateway.model.suffix_drafts import SuffixDrafts
from tests.helpers.kept_chats import ended_chats, keeping_chats, plain_reference
from tests.tiny_models import VOCAB, GetTinyModel, TinyModel
from tests.unit.gateway.model.test_speculative_engine import (
    ATOL,
    NEW_TOKENS,
    PROMPT,
    LocalEngine,
    local_engine,
    pooled_chi_square_pvalue,
    run,
)
from tests.unit.swarm_node.test_span_exactness import build_chain


class OracleTree(PromptLookup):
    """Trees from a known output: at each depth the right token and a wrong sibling, the wrong one listed first
    (the likelier share) at every third depth, both wrong at every fifth: rounds keep first branches, other
    branches, and nothing."""

    def __init__(self, prompt_ids: list[int], tuner: SpecTuner, reference: list[int]) -> None:
        super().__init__(prompt_ids, tuner)
        self._emitted_from = len(prompt_ids)
        self._reference = reference

    def propose_tree(self, depth: int, after: Sequence[int] = (), forced: int = 0) -> ScoredTree | None:
        done = len(self.context) + len(after) - self._emitted_from
        tokens: list[int] = []
        parents: list[int] = []
        below = -1
        for index, right in enumerate(self._reference[done : done + depth]):
            at = done + index
            wrong = (right + 1) % VOCAB
            pair = [(right + 2) % VOCAB, wrong] if at % 5 == 4 else [wrong, right] if at % 3 == 1 else [right, wrong]
            tokens += pair
            parents += [below, below]
            below = len(tokens) - (1 if pair[1] == right else 2)  # the chain goes on under the right token
        return ScoredTree(DraftTree(tokens, parents), [0.6, 0.4] * (len(tokens) // 2)) if tokens else None


class TreeEngine(LocalEngine):
    def _drafter(self, request: GenerationRequest) -> PromptLookup | None:
        drafter = super(LocalEngine, self)._drafter(request)
        if drafter is None or self._oracle is None:
            return drafter
        return OracleTree(request.prompt_ids, drafter.tuner, self._oracle)


def tree_engine(tiny: TinyModel, speculative: str, oracle: list[int] | None = None) -> TreeEngine:
    engine = local_engine(tiny.folder, build_chain(tiny.folder, (3,)), speculative, oracle, trees=True)
    engine.__class__ = TreeEngine
    return engine  # type: ignore[return-value]


async def plain_and_tree(tiny: TinyModel, request: GenerationRequest) -> tuple[list[GeneratedToken], ...]:
    plain_engine = tree_engine(tiny, "off")
    try:
        plain = await run(plain_engine, request)
    finally:
        await plain_engine.heads.close()
    engine = tree_engine(tiny, "ngram", oracle=[t.token_id for t in plain])
    try:
        tree = await run(engine, request)
    finally:
        await engine.heads.close()
    steps = engine.chains[0].trees
    assert any(tree is not None for tree, _ in steps)  # tree steps verified
    assert any(branch for _, branch in steps)  # and branches other than the first slots kept
    return plain, tree


@pytest.mark.parametrize("variant", ["llama", "gemma2", "mistral", "bloom", "falcon_new"])
async def test_greedy_with_tree_drafts_equals_greedy_without(tiny_model: GetTinyModel, variant: str) -> None:
    metrics = GatewayMetrics()
    current_metrics.set(metrics)
    request = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0), logprobs=2)
    plain, tree = await plain_and_tree(tiny_model(variant), request)
    assert [t.token_id for t in tree] == [t.token_id for t in plain]
    for got, want in zip(tree, plain, strict=True):  # the model's own logprobs, whichever node computed them
        assert got.logprob == pytest.approx(want.logprob, abs=ATOL)
        assert [i for i, _ in got.top] == [i for i, _ in want.top]
    assert metrics.spec_accepted._value.get() > 0


async def test_seeded_sampling_with_penalties_gives_the_same_tokens_with_trees(tiny_model: GetTinyModel) -> None:
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=11, presence_penalty=0.3, repetition_penalty=1.1)
    plain, tree = await plain_and_tree(tiny_model("llama"), GenerationRequest(PROMPT, NEW_TOKENS, params))
    assert [t.token_id for t in tree] == [t.token_id for t in plain]


def test_the_tree_walk_keeps_the_models_distribution(tiny_model: GetTinyModel) -> None:
    """A tree of two drafts below the fed token: first token x ~ p0; when x is one of them, the second token ~ p(. |
    x) from the same tree step (its own branch's logits), x counted by the penalties. 20,000 seeded rounds against
    those exact probabilities (chi-square)."""
    tiny = tiny_model("llama")
    chain = build_chain(tiny.folder, (3,))
    engine = local_engine(tiny.folder, chain, "ngram", trees=True)
    temperature, penalty = 0.5, 0.8
    prompt = PROMPT[:8]
    with torch.inference_mode():
        p0 = torch.softmax(chain.step(torch.tensor([prompt]), chain.new_session(), 0)[0, -1] / temperature, dim=-1)
        drafts = [int(t) for t in p0.topk(2).indices]
        session = chain.new_session()
        chain.step(torch.tensor([prompt[:-1]]), session, 0)
        hidden = chain.head.embed(torch.tensor([[prompt[-1], *drafts]]))
        for span, kv in zip(chain.spans, session, strict=True):
            hidden = span(hidden, [kv], [len(prompt) - 1], range(span.start, span.end), parents=[-1, 0, 0])
        logits = chain.head.logits(hidden)[0]  # [3, V]: after the prompt, after each draft
    params = SamplingParams(temperature=temperature, presence_penalty=penalty)
    p0 = torch.softmax(logits[0] / temperature, dim=-1).double()
    after = [
        torch.softmax((logits[1 + i] - penalty * (torch.arange(VOCAB) == d)) / temperature, -1)
        for i, d in enumerate(drafts)
    ]
    assert 0.2 < float(p0[drafts].sum()) < 0.9  # every branch of the walk gets exercised
    request = GenerationRequest(prompt, 10, params)
    counts = torch.zeros(3, VOCAB, dtype=torch.float64)  # [first token (no draft) | second after draft 0 | draft 1]
    for seed in range(20_000):
        sampler = Sampler(params.with_seed(seed), VOCAB, prompt)
        pick = functools.partial(pick_token, sampler=sampler, stop_ids=engine.stop_ids, num_logprobs=None)
        round_ = verify_round(logits, drafts, pick, DecodePlan(request, None), 0, engine._embed, parents=[-1, -1])
        tokens = round_.tokens
        if tokens[0].token_id not in drafts:
            assert len(tokens) == 1 and round_.path == []
            counts[0, tokens[0].token_id] += 1
        else:
            branch = drafts.index(tokens[0].token_id)
            assert round_.path == [branch]
            counts[1 + branch, tokens[1].token_id] += 1
    not_drafted = torch.ones(VOCAB, dtype=torch.bool)
    not_drafted[drafts] = False
    expected = torch.stack([p0 * not_drafted, p0[drafts[0]] * after[0], p0[drafts[1]] * after[1]]) * 20_000
    assert pooled_chi_square_pvalue(counts, expected) > 1e-3


async def test_a_kept_conversation_holds_exactly_its_tokens_after_tree_rounds(tiny_model: GetTinyModel) -> None:
    """Ended amid a tree round (an end-of-sequence token): the nodes keep the walked branch, moved into place: their
    keys and values are a fresh prefill's of the kept tokens."""
    tiny = tiny_model("llama")
    plain_engine = tree_engine(tiny, "off")
    reference = await plain_reference(plain_engine, PROMPT, 30)
    moved = 0
    async with keeping_chats(tree_engine(tiny, "ngram", oracle=reference)) as engine:
        async for chat in ended_chats(engine, PROMPT, reference):
            held, local = list(chat.kept.token_ids), chat.chain
            assert local.lengths == {len(held)}
            fresh = engine.local.new_session()
            with torch.inference_mode():
                engine.local.step(torch.tensor([held]), fresh, 0)
            for got, want in zip(local._kvs, fresh, strict=True):
                torch.testing.assert_close(got.keys[:, :, : len(held)], want.keys[:, :, : len(held)], atol=ATOL, rtol=0)
            moved += local.truncated != [] and any(branch for _, branch in local.trees)
        assert moved > 0


def test_a_chain_of_chances_is_choose_k() -> None:
    for acceptance in (0.3, 0.6, 0.9):
        for rtt in (0.02, 0.1):
            chances = [acceptance ** (i + 1) for i in range(8)]
            assert choose_tree(chances, rtt, 0.03, 8) == choose_k(acceptance, rtt, 0.03, 8, 0.0)


def test_chances_go_to_the_likeliest_child_and_the_rest_by_share() -> None:
    tree = ScoredTree(DraftTree([4, 5, 8, 9], [-1, -1, 0, 0]), [0.75, 0.25, 0.5, 0.5])
    chances = node_chances(tree, 0.6)
    assert chances == pytest.approx([0.6, 0.4, 0.36, 0.24])
    kept = prune_tree(tree, chances, 3)
    assert kept == DraftTree([4, 5, 8], [-1, -1, 0])
    deep = ScoredTree(DraftTree([1, 2, 3], [-1, 0, 1]), [1.0, 1.0, 1.0])
    assert prune_tree(deep, node_chances(deep, 0.9), 2) == DraftTree([1, 2], [-1, 0])


def test_suffix_trees_branch_where_the_places_disagree() -> None:
    text = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 7, 7, 1, 2, 3, 4, 8, 8, 1, 2, 3]
    scored = SuffixDrafts(text, SpecTuner(8, 0.0)).propose_tree(3)
    assert scored is not None
    tree = scored.tree
    assert tree.tokens[:2] == [4, 5] and tree.parents[:2] == [-1, -1]  # two of three places say 4, one says 5
    assert scored.shares[:2] == pytest.approx([2 / 3, 1 / 3])
    children_of_4 = sorted(t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == 0)
    assert children_of_4 == [8, 9]
    assert tree.depth() == 3
    assert SuffixDrafts([1, 2, 3, 4], SpecTuner(8, 0.0)).propose_tree(3) is None
