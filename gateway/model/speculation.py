"""Speculative decoding: draft tokens cheaply at the gateway, verify k of them in one pass through the chain.

    fed tokens ... t | d1 .. dk  ─one step of k+1 positions→ hidden [1, k+1, D] ─LM head→ logits [k+1, V]
    position i:  x_i = sampler(logits[i])  → emit x_i;  x_i == d_{i+1} ? go on : stop   (x_k is the bonus token)

Drafts come from prompt lookup (``propose_ngram``: the text so far repeated, no extra model). Acceptance uses the
request's own sampler on each position's logits, in order, so every emitted token is exactly what step-by-step
decoding would sample there: greedy output equals non-speculative decoding, penalties see the tokens before each
position, a grammar mask advances only over emitted tokens, and a seeded request draws from its generator the same
way as without speculation (one draw per emitted token). For a draft proposed with certainty (q a point mass, as
prompt lookup's are), sampling x ~ p and accepting iff x == d *is* the speculative sampling rule: the draft is
accepted with probability p(d) = min(1, p(d)/q(d)), and a rejection's x is distributed as p without d, renormalized
— the residual max(p - q, 0) normalized.

How many to draft (``choose_k``) is a small cost model, decided per round and per generation: a verify round costs
the chain's round trip plus compute that grows a little per position, and yields (1 - a^(k+1)) / (1 - a) tokens at a
per-draft acceptance a. Under load the verify step rides in the same batched node forwards as the other
generations' decode steps (a node's batch carries rows of different lengths): its k extra positions cost the
batched forward a fraction of a row each, which the round pays for every row that waits on it (its own and the B
others'), not "off while another generation runs". Below ``min_rtt`` (loopback) nothing is drafted: there the
extra positions cost more than the round trips they save. The cost model and the per-generation estimates live in
``spec_tuner`` (with how a priced-out tuner re-probes, and the gate's hysteresis around ``min_rtt``).

**Trees.** A drafter may propose several continuations at once (``DraftTree``: each draft's parent among them; the
nodes verify them in one step, each attending to its own ancestors only). The walk (``verify_tree``) is the chain
rule applied node by node: sample x from the current node's logits with the request's sampler, emit it, descend to
the child whose token is x if there is one, else stop. Every emitted token is still sampled from the model's own
distribution after exactly the tokens before it (the tree only decides whether those logits were computed already),
so greedy output equals plain decoding and sampling keeps the model's distribution: with point-mass drafts, picking
x ~ p and descending iff x is a child is the multi-draft speculative rule (a child d is taken with probability p(d),
and a stop emits x ~ p restricted to the tokens no child has). Which nodes to send (``choose_tree``) is the same cost
model as ``choose_k``: each node adds a position and the chance that it is reached and kept (``node_chances``: the
tuner's acceptance for the drafter's first choice, its leftover split among the others by the drafter's shares); a
chain of k is the tree whose chances are a, a², ..., aᵏ. A tree step runs alone on each node (its own forward, on
the session's own stream), so while other generations decode the drafts stay a chain, which rides their batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from gateway.generation import GeneratedToken, GenerationRequest
from gateway.metrics import spec_verified
from gateway.model.spec_tuner import EWMA, MIN_GAIN, POSITION_COST, SpecTuner, choose_k, expected_tokens

__all__ = [
    "EWMA",
    "DecodePlan",
    "DraftTree",
    "ScoredTree",
    "choose_tree",
    "node_chances",
    "verify_tree",
    "Drafter",
    "PromptLookup",
    "Verified",
    "SpecTuner",
    "choose_k",
    "verify_drafts",
    "common_prefix",
    "expected_tokens",
    "propose_ngram",
]

MAX_NGRAM = 4  # longest suffix looked up in the text so far
MIN_NGRAM = 2  # a single repeated token predicts too little to pay for its positions
TREE_WIDTH = 2  # a tree's nodes per depth of its drafts, at most: its positions cost compute


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree: ``parents[i]`` is draft i's parent among them (-1: the token fed before them, the
    last one emitted); parents come before their children and siblings carry different tokens. A chain is the tree
    of parents -1, 0, 1, ..."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        return all(parent == index - 1 for index, parent in enumerate(self.parents))

    def step_parents(self) -> list[int]:
        """The verify step's tree (``wire.Step.tree``): the fed token first (-1), each draft below its parent."""
        return [-1, *(parent + 1 for parent in self.parents)]

    def children(self) -> dict[int, dict[int, int]]:
        """node (-1: the fed token) -> {child's token: child}."""
        found: dict[int, dict[int, int]] = {}
        for index, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            found.setdefault(parent, {}).setdefault(token, index)
        return found

    def depth(self) -> int:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)


@dataclass(frozen=True)
class ScoredTree:
    """A drafter's tree with each node's share: how much of the drafter's belief in its parent's path goes to it
    (a suffix match's fraction of places, a draft model's probability)."""

    tree: DraftTree
    shares: list[float]


def node_chances(scored: ScoredTree, acceptance: float) -> list[float]:
    """Each node's chance of being reached and kept: ``acceptance`` for its parent's likeliest child, the rest of its
    parent's chance split among the other children by their shares of what the likeliest leaves."""
    tree, chances = scored.tree, list[float]()
    best: dict[int, float] = {}
    for share, parent in zip(scored.shares, tree.parents, strict=True):
        best[parent] = max(best.get(parent, 0.0), share)
    firsts: set[int] = set()
    for share, parent in zip(scored.shares, tree.parents, strict=True):
        above = 1.0 if parent < 0 else chances[parent]
        if parent not in firsts and share == best[parent]:
            firsts.add(parent)
            chances.append(above * acceptance)
        else:
            left = max(1e-9, 1.0 - best[parent])
            chances.append(above * (1.0 - acceptance) * min(1.0, share / left))
    return chances


def choose_tree(
    chances: Sequence[float],
    rtt: float,
    compute: float,
    size_max: int,
    plain_rtt: float | None = None,
    position_cost: float = POSITION_COST,
) -> int:
    """How many of a tree's nodes (the likeliest first, ``chances`` in descending order) the next step carries: the
    count with the least expected time per token, a round costing ``rtt + compute * (1 + position_cost * n)`` and
    yielding 1 + the sum of the nodes' chances, against ``plain_rtt + compute`` for a plain step (as ``choose_k``;
    the drafting is done already)."""
    plain = (rtt if plain_rtt is None else plain_rtt) + compute
    best_n, best, gained = 0, plain, 1.0
    for n, chance in enumerate(chances[:size_max], start=1):
        gained += chance
        per_token = (rtt + compute * (1.0 + position_cost * n)) / gained
        if per_token < best:
            best_n, best = n, per_token
    return best_n if best * MIN_GAIN <= plain else 0


def prune_tree(scored: ScoredTree, chances: Sequence[float], size: int) -> DraftTree:
    """The ``size`` likeliest nodes of a tree (parents before children: a child is never likelier), reindexed."""
    order = sorted(range(len(chances)), key=lambda node: (-chances[node], node))[:size]
    kept = sorted(order)  # a parent's index is below its child's, and a child's chance is at most its parent's
    index = {node: new for new, node in enumerate(kept)}
    tree = scored.tree
    if any(tree.parents[node] >= 0 and tree.parents[node] not in index for node in kept):
        kept = [node for node in kept if _ancestors_kept(tree, node, index)]
        index = {node: new for new, node in enumerate(kept)}
    return DraftTree([tree.tokens[n] for n in kept], [index.get(tree.parents[n], -1) for n in kept])


def _ancestors_kept(tree: DraftTree, node: int, kept: dict[int, int]) -> bool:
    while tree.parents[node] >= 0:
        node = tree.parents[node]
        if node not in kept:
            return False
    return True


def propose_ngram(context: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last n tokens (longest n
    first, from ``max_ngram`` down to ``min_ngram``); [] when the suffix never occurred before."""
    if k <= 0:
        return []
    tokens = list(context)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest match first; the suffix itself is excluded
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


class Drafter(Protocol):
    """One generation's source of drafts."""

    threaded: bool  # ``propose`` is costly: the engine runs it in a thread of its own, not the head batcher's
    tuner: SpecTuner
    # Seconds of the last ``propose`` that were no cost per drafted token: a draft model reading the whole prompt
    # into its cache on its first proposal, or the tokens of the rounds that drafted nothing before a probe.
    # Charged to the drafted tokens, such a read would price drafting out again (``spec_tuner``'s re-probing).
    unpriced: float

    def emitted(self, token_id: int) -> None: ...

    def propose(self, k: int, after: Sequence[int] = (), forced: int = 0) -> list[int]:
        """Up to ``k`` drafts after the text so far and then ``after`` (drafts already chosen), the last ``forced`` of
        which the grammar forced (a key's quotes and colon: text the schema repeats, no sign of what follows)."""
        ...


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    """A drafter that may propose several continuations at once."""

    def propose_tree(self, depth: int, after: Sequence[int] = (), forced: int = 0) -> ScoredTree | None:
        """Candidate drafts up to ``depth`` deep after the text so far and ``after`` (more than a step should carry:
        the plan keeps the likeliest; ``forced`` as ``propose``'s); None or an empty tree when there is nothing to
        draft."""
        ...


class PromptLookup:
    """One generation's drafter: prompt lookup over the prompt and the tokens emitted so far."""

    threaded = False  # microseconds: done in the head batcher's thread, beside the sampling
    unpriced = 0.0

    def __init__(self, prompt_ids: Sequence[int], tuner: SpecTuner) -> None:
        self.context = list(prompt_ids)
        self.tuner = tuner

    def emitted(self, token_id: int) -> None:
        self.context.append(token_id)

    def propose(self, k: int, after: Sequence[int] = (), forced: int = 0) -> list[int]:
        return propose_ngram([*self.context, *after] if after else self.context, k)


@dataclass
class Verified:
    """One round at the head: the tokens emitted, how many of the round's drafts they kept (which: ``path``), whether
    the generation is over; if not, the next step's drafts (the first ``forced`` of them the grammar's, a chain; a
    tree after them when ``parents``) and its input embeddings [1, 1 + len(drafts), D]."""

    tokens: list[GeneratedToken]
    accepted: int
    done: bool
    drafts: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    forced: int = 0
    path: list[int] = field(default_factory=list)  # the round's drafts kept (their indices in the last step's tree)
    parents: list[int] | None = None  # the next step's drafts as a tree (``DraftTree.parents``); None: a chain


class ForcedTokens(Protocol):
    """A constrained request's grammar as a drafter sees it (``Constraint``)."""

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, as drafts."""
        ...

    def forced_after(self, drafts: Sequence[int]) -> list[int]:
        """The tokens the grammar forces after ``drafts``."""
        ...

    def allowed_drafts(self, before: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """A drafter's ``drafts`` after ``before``, respelled, up to the first the grammar forbids."""
        ...

    def respell(self, drafted: int, chosen: int) -> None:
        """The model chose ``chosen`` where the forced draft ``drafted`` stood: spell later forced bytes its way."""
        ...

    def respell_draft(self, drafted: int, chosen: int) -> None:
        """The model chose ``chosen`` where a drafter's ``drafted`` stood: spell later such drafts its way."""
        ...


class DecodePlan:
    """When one generation stops and what it drafts next (nothing without a drafter): the grammar's forced tokens
    (``grammar``, a constrained request's ``Constraint``) first, then the drafter's after them."""

    def __init__(
        self, request: GenerationRequest, drafter: Drafter | None, grammar: ForcedTokens | None = None
    ) -> None:
        self._max_new = request.max_new_tokens
        self._ignore_eos = request.ignore_eos
        self._drafter = drafter
        self._grammar = grammar
        self._forcing = False  # this round proposes the forced tokens (``next_k`` decides)
        self._rtt: float = 0.0  # the round trips ``next_k`` was given: a tree's size is chosen by them too
        self._plain_rtt: float | None = None
        self._others = 0  # generations decoding beside this one at the last ``next_k``: a tree would leave their batch
        self.count = 0  # tokens emitted
        self.done = False

    def emitted(self, token: GeneratedToken) -> None:
        self.count += 1
        if self._drafter is not None:
            self._drafter.emitted(token.token_id)
        self.done = self.count >= self._max_new or (token.eos and not self._ignore_eos)

    def next_k(
        self, rtt: float, others: int, plain_rtt: float | None = None, frame: tuple[float, int] | None = None
    ) -> int:
        """Drafts worth verifying in the next step, by the drafter's estimates, this round: ``others`` generations
        decode through this gateway now, their rows in the same node forwards as the verify step (``choose_k``
        charges its extra positions to them too); ``frame``: a relayed traversal's round trips and hops, for frames
        sent ahead."""
        self._forcing = False
        self._rtt, self._plain_rtt, self._others = rtt, plain_rtt, others
        if self._drafter is None:
            return 0
        tuner = self._drafter.tuner
        self._forcing = self._grammar is not None and tuner.forcing_pays(rtt, plain_rtt, others)
        frame_rtt, hops = frame if frame is not None else (None, 1)
        return tuner.next_k(rtt, self._max_new - self.count, plain_rtt, others, frame_rtt, hops)

    @property
    def pipelined(self) -> bool:
        """Whether this round's step goes as a frame with the next one sent ahead (the tuner chose it at
        ``next_k``). A draft model then drafts the frame ahead while the one before it travels the chain."""
        drafter = self._drafter
        return drafter is not None and drafter.tuner.pipelined

    def propose_ahead(self, after: Sequence[int], k: int) -> list[int]:
        """The tokens of a frame sent ahead of one carrying drafts ``after``, assumed kept whole: a guess of that
        frame's bonus token, then up to ``k`` drafts after it; [] when the generation ends before it could be fed
        (max_new_tokens). The grammar's forced tokens are not asked: its state is that of the tokens emitted."""
        left = self._max_new - self.count - len(after) - 1  # tokens still to emit once the frame in flight is kept
        drafter = self._drafter
        if drafter is None or left < 1:
            return []
        started, size = time.perf_counter(), min(k, left - 1) + 1
        tokens = drafter.propose(size, after)[:size]
        drafter.tuner.record_draft(time.perf_counter() - started - drafter.unpriced, len(tokens))
        return tokens

    @property
    def threaded(self) -> bool:
        return self._drafter is not None and self._drafter.threaded

    def propose(self, k: int) -> tuple[list[int], int]:
        """The tokens the grammar forces next (when this round forces), then up to ``k`` drafts after them; never
        one that could only be emitted past max_new_tokens -> (the drafts, how many of them are forced)."""
        tree, forced = self.propose_tree(k, trees=False)
        return tree.tokens, forced

    def propose_tree(self, k: int, trees: bool = True) -> tuple[DraftTree, int]:
        """As ``propose``, the drafts after the forced tokens a tree up to ``k`` deep when the drafter proposes
        trees (and ``trees``): its likeliest nodes, as many as ``choose_tree`` finds worth a step's positions."""
        room = self._max_new - self.count - 1  # the token just emitted is fed with them; the last needs no feeding
        if self._drafter is None or room <= 0:
            return DraftTree([], []), 0
        forced = self._grammar.forced()[:room] if self._forcing and self._grammar is not None else []
        depth = min(k, room - len(forced))
        if depth <= 0:
            return DraftTree.chain(forced), len(forced)
        started = time.perf_counter()
        drafter = self._drafter
        if trees and self._others == 0 and isinstance(drafter, TreeDrafter):
            scored = drafter.propose_tree(depth, forced, len(forced))
            slots = room - len(forced)  # every tree token takes a slot of the session, a branch or not
            drafted = self._pruned(scored, depth, slots) if scored is not None else DraftTree([], [])
            drafter.tuner.record_draft(time.perf_counter() - started - drafter.unpriced, len(drafted.tokens))
        else:
            chain, left, unpriced = self._drafted_chain(forced, depth, room)
            drafter.tuner.record_draft(time.perf_counter() - started - unpriced, depth - left)
            drafted = DraftTree.chain(chain[len(forced) :])
        below = len(forced) - 1  # the drafts hang below the last forced token
        parents = [below + 1 + parent if parent >= 0 else below for parent in drafted.parents]
        return DraftTree(forced + drafted.tokens, list(range(-1, below)) + parents), len(forced)

    def _drafted_chain(self, forced: list[int], depth: int, room: int) -> tuple[list[int], int, float]:
        """``forced``, then up to ``depth`` of the drafter's drafts, each run of them followed by what the grammar
        forces after it (a value's closing quote drafted, then the next key: one step carries both), within
        ``room`` -> (the chain, the drafter's ``depth`` left unused, the proposals' ``unpriced`` seconds). With a
        grammar, drafts it forbids are cut."""
        assert self._drafter is not None
        chain, tail, left, unpriced = list(forced), len(forced), depth, 0.0
        while left > 0 and len(chain) < room:
            drafts = self._drafter.propose(min(left, room - len(chain)), chain, tail)
            unpriced += self._drafter.unpriced
            if self._grammar is not None:
                drafts = self._grammar.allowed_drafts(chain, drafts)
            chain += drafts
            left -= len(drafts)
            if not drafts or not self._forcing or self._grammar is None:
                break
            more = self._grammar.forced_after(chain)[: room - len(chain)]
            if not more:
                break
            chain += more
            tail = len(more)
        return chain, left, unpriced

    def _pruned(self, scored: ScoredTree, depth: int, slots: int) -> DraftTree:
        """The likeliest nodes of the drafter's tree that pay for their positions (a chain of them where a chain
        pays best)."""
        assert self._drafter is not None
        tuner = self._drafter.tuner
        chances = node_chances(scored, tuner.acceptance)
        ranked = sorted(chances, reverse=True)
        size = choose_tree(ranked, self._rtt, tuner.compute, min(TREE_WIDTH * depth, slots), self._plain_rtt)
        return prune_tree(scored, chances, max(1, size))

    def kept(self, drafts: Sequence[int], forced: int, accepted: int, tokens: Sequence[GeneratedToken]) -> None:
        """A step's chain of ``drafts`` was verified, the first ``forced`` of them the grammar's: ``accepted`` kept,
        then ``tokens[accepted]`` sampled (when the round emitted one there). A draft the model did not keep, where it
        chose another spelling of the same bytes, teaches the grammar that spelling: under a compact JSON grammar
        SmolLM2 writes ``":`` then ``"`` where llguidance's canonical ``":"`` was drafted (a forced draft), and ``",``
        where a value copied from the prompt met the prompt's ``,`` (a drafter's), so every later key's or value's
        draft broke there."""
        if self._grammar is None or accepted >= len(drafts) or accepted >= len(tokens):
            return
        if accepted < forced:
            self._grammar.respell(drafts[accepted], tokens[accepted].token_id)
        else:
            self._grammar.respell_draft(drafts[accepted], tokens[accepted].token_id)

    def verified(self, drafted: int, accepted: int, forced: int = 0) -> None:
        if self._drafter is not None and drafted > 0:
            self._drafter.tuner.record_round(drafted, accepted, forced)
            spec_verified(drafted, accepted)

    def stepped(self, seconds: float, rtt: float) -> None:
        if self._drafter is not None:
            self._drafter.tuner.record_step(seconds, rtt)


def verify_drafts(
    logits: torch.Tensor, drafts: Sequence[int], pick: Callable[[torch.Tensor], GeneratedToken], plan: DecodePlan
) -> tuple[list[GeneratedToken], int]:
    """logits [1 + len(drafts), V]: after the last emitted token, then after each draft -> (the tokens emitted, the
    drafts kept). ``pick`` is the request's own sampling of one position; a draft is kept while it equals the pick."""
    tokens: list[GeneratedToken] = []
    for row in logits:
        tokens.append(pick(row))
        plan.emitted(tokens[-1])
        if plan.done or len(tokens) > len(drafts) or tokens[-1].token_id != drafts[len(tokens) - 1]:
            break
    accepted = sum(1 for token, draft in zip(tokens, drafts, strict=False) if token.token_id == draft)
    return tokens, accepted


def verify_tree(
    logits: torch.Tensor, tree: DraftTree, pick: Callable[[torch.Tensor], GeneratedToken], plan: DecodePlan
) -> tuple[list[GeneratedToken], list[int]]:
    """logits [1 + len(tree.tokens), V]: after the last emitted token, then after each draft -> (the tokens emitted,
    the drafts kept: the path walked). From the fed token down: ``pick`` (the request's own sampling) emits a token
    from the current node's logits; the walk descends to the child carrying that token, or stops. A kept draft is
    on the path even when its token ends the generation (its keys and values are the nodes' as it was fed)."""
    children = tree.children()
    tokens: list[GeneratedToken] = []
    path: list[int] = []
    node = -1
    while True:
        tokens.append(pick(logits[node + 1]))
        plan.emitted(tokens[-1])
        child = children.get(node, {}).get(tokens[-1].token_id)
        if child is not None:
            path.append(child)
        if plan.done or child is None:
            return tokens, path
        node = child
