"""One generation's decode loop, in small named steps (as gpt-fast's ``prefill`` / ``decode_one_token``):

    prefill      the chain takes the prompt; its last block's output [1, T, D] comes back
    round        score → verify → emit: the head scores the last step's positions, the request's sampler picks each
                 in order (keeping drafts while they equal its picks), and the next step's drafts are proposed
    advance      the chain takes the last token and the new drafts: one traversal, [1, 1 + k, D] back
    finish       the nodes' caches rolled back to the tokens kept, the chain kept for the conversation's next turn
                 or closed

Where acceptance is high the tuner pipelines (``spec_tuner.pipelining_pays``): advance sends its step as a frame
(``FrameChain.frame``) and, before awaiting it, the next frame, drafted as if this one were kept whole (its bonus
token guessed by the drafter too). The next round takes that frame when its guess held (the position and the token
fed agree) and sends another ahead; else it voids it and steps again from the first token not kept. Rounds still
verify one frame after another with the request's own sampler, so what is emitted is what plain decoding emits.

``held`` is the one count of what the nodes hold: the token ids in their caches, in slot order, the last step's
drafts included (until a round says which of them stay: ``kept``). A tree step's kept branch need not be its first
slots: the next step (or the final roll-back) names the slots to keep (``branch``), and the nodes move them into
place. The engine owns the processes and the swarm; it hands each
generation its services (``Services``) once, so no step threads the request's adapter or the engine through.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch

from gateway.generation import EngineEvent, GeneratedToken, GenerationRequest, PromptCached, PromptScores
from gateway.model.head_batcher import HeadBatcher
from gateway.model.sampling import Sampler, top_logprobs
from gateway.model.speculation import DecodePlan, DraftTree, Verified, verify_tree

logger = logging.getLogger(__name__)

__all__ = ["Chain", "Generation", "Services", "pick_token", "verify_round"]


class Chain(Protocol):
    """What a generation needs of its ``ChainSession``."""

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor: ...

    async def truncate(self, length: int) -> None: ...

    async def close(self) -> None: ...


class TreeChain(Chain, Protocol):
    """A chain whose nodes verify trees (``ChainSession``): steps carry a tree, and keep one branch of the last."""

    async def step(
        self, hidden: torch.Tensor, position: int, tree: list[int] | None = None, branch: list[int] | None = None
    ) -> torch.Tensor: ...

    async def truncate(self, length: int, branch: list[int] | None = None) -> None: ...


class SentFrame(Protocol):
    """A verify step in flight (``gateway.swarm.frames.Frame``)."""

    async def output(self) -> torch.Tensor | None: ...

    def void(self) -> None: ...


@runtime_checkable
class FrameChain(Chain, Protocol):
    """A chain that takes pipelined verify frames (``ChainSession``)."""

    def frame(self, hidden: torch.Tensor, position: int, ahead: bool = False) -> SentFrame: ...


@dataclass(frozen=True)
class Ahead:
    """A frame in flight and what it carries: ``tokens`` (the token fed, then its drafts) at ``position``."""

    frame: SentFrame
    hidden: torch.Tensor  # [1, len(tokens), D]
    tokens: list[int]
    position: int


@dataclass(frozen=True)
class Services:
    """What the engine lends one generation, bound to its request (its adapter, its scope) where they need it."""

    heads: HeadBatcher  # every session's LM head and sampling, batched
    prefill: Callable[[], Awaitable[tuple[Chain, torch.Tensor, int]]]  # -> chain, output [1, T, D], tokens cached
    embed: Callable[[list[int]], torch.Tensor]  # ids [T] -> the first block's input [1, T, D]
    prompt_scores: Callable[[torch.Tensor], PromptScores]  # prefill output -> the prompt tokens' logprobs
    # seconds of the chain's round trips (the chain ``prefill`` returned): a verify step's, a decode step's
    round_trips: Callable[[Any], tuple[float, float]]
    others: Callable[[], int]  # other generations in flight on this gateway
    keep: Callable[[list[int], Chain], Awaitable[None]] | None  # park the chain for the conversation's next turn
    stop_ids: Collection[int]
    frame_rtt: Callable[[Any], tuple[float, int]] | None = None  # a relayed traversal's round trips (s) and hops


def pick_token(
    logits: torch.Tensor, sampler: Sampler, stop_ids: Collection[int], num_logprobs: int | None
) -> GeneratedToken:
    """The next token from one position's logits [V], with the model's own logprobs when asked."""
    token = sampler.next_token(logits)
    eos = token in stop_ids
    if num_logprobs is None:
        return GeneratedToken(token, eos)
    logprobs = torch.log_softmax(logits, dim=-1)  # [V]
    return GeneratedToken(token, eos, float(logprobs[token]), top_logprobs(logprobs, num_logprobs))


def verify_round(
    logits: torch.Tensor,
    drafts: list[int],
    pick: Callable[[torch.Tensor], GeneratedToken],
    plan: DecodePlan,
    k: int,
    embed: Callable[[list[int]], torch.Tensor],
    parents: list[int] | None = None,
    trees: bool = False,
    forced: int = 0,
) -> Verified:
    """logits [1 + len(drafts), V]: the output after the last emitted token and after each draft (``parents``: the
    drafts as a tree, ``DraftTree``; the first ``forced`` of them the grammar's) -> the tokens the model's own
    sampling emits (a draft is kept while the sample equals it: ``verify_tree``), up to ``k`` next drafts (a tree
    with ``trees``) and the next step's input embeddings [1, 1 + k', D].

    Run by the head batcher's worker thread: embedding there saves each session a hop to a thread per step."""
    tree = DraftTree.chain(drafts) if parents is None else DraftTree(drafts, parents)
    tokens, path = verify_tree(logits, tree, pick, plan)
    plan.kept(drafts if parents is None else drafts[:forced], forced, len(path), tokens)
    if plan.done:
        return Verified(tokens, len(path), True, path=path)
    return with_drafts(Verified(tokens, len(path), False, path=path), plan, k, embed, trees)


def with_drafts(
    round_: Verified, plan: DecodePlan, k: int, embed: Callable[[list[int]], torch.Tensor], trees: bool = False
) -> Verified:
    """``round_`` with up to ``k`` drafts after its tokens (a tree with ``trees``), and the next step's input
    embeddings for them."""
    following, forced = plan.propose_tree(k, trees)
    hidden = embed([round_.tokens[-1].token_id, *following.tokens])
    parents = None if following.is_chain else following.parents
    return Verified(round_.tokens, round_.accepted, False, following.tokens, hidden, forced, round_.path, parents)


class Generation:
    """One request from its prefill to its last token: ``run`` yields its events."""

    def __init__(
        self, request: GenerationRequest, services: Services, sampler: Sampler, plan: DecodePlan, trees: bool = False
    ) -> None:
        self.request = request
        self.services = services
        self.sampler = sampler
        self.plan = plan
        self.trees = trees  # drafts may be trees: the chain's nodes verify them (``TreeChain``)
        self.held = list(request.prompt_ids)  # the ids the nodes' caches hold, in slot order, the last step's drafts
        self.base = len(self.held) - 1  # the slot of the last step's first token (the one fed before its drafts)
        self.drafts: list[int] = []  # the last step's drafts: the tail of ``held``, verified by the next round
        self.parents: list[int] | None = None  # the last step's drafts as a tree (None: a chain)
        self.forced = 0  # how many of ``drafts`` (the first) are the grammar's forced tokens
        self.kept = list(self.held)  # after a round: the ids the nodes keep, in position order
        self.branch: list[int] | None = None  # after a round: the slots of a kept tree branch that must move
        self._pick = functools.partial(
            pick_token, sampler=sampler, stop_ids=services.stop_ids, num_logprobs=request.logprobs
        )
        self._chain: Chain | None = None
        self._output = torch.empty(0)  # the last step's output [1, T, D]
        self._ended_well = False
        self._k = 0  # drafts per step this round (a frame sent ahead carries as many)
        self.ahead: Ahead | None = None  # the frame sent ahead of the last step, guessing it kept whole
        self._sent_end = 0  # the furthest position a frame ahead wrote to: a void one may have reached some nodes

    async def run(self) -> AsyncGenerator[EngineEvent, None]:
        try:
            async for event in self.prefill():
                yield event
            while self.request.max_new_tokens > 0:
                round_ = await self.round()
                for token in round_.tokens:
                    yield token
                if round_.done:
                    break  # the last token is never fed: nothing would read its output
                await self.advance(round_)
            self._ended_well = True
        finally:
            await self.finish()

    async def prefill(self) -> AsyncGenerator[EngineEvent, None]:
        """The chain takes the prompt (what a kept conversation held of it is not sent again)."""
        self._chain, self._output, cached = await self.services.prefill()
        if cached:
            yield PromptCached(cached)
        if self.request.prompt_logprobs is not None:
            yield await asyncio.to_thread(self.services.prompt_scores, self._output)

    async def round(self) -> Verified:
        """Score the last step's positions, keep the drafts the sampler agrees with, propose the next drafts."""
        k = self._k = self._next_k()
        verify = functools.partial(
            verify_round,
            drafts=self.drafts,
            pick=self._pick,
            plan=self.plan,
            k=0 if self.plan.threaded else k,
            embed=self.services.embed,
            parents=self.parents,
            trees=self.trees,
            forced=self.forced,
        )
        scored = self._output[:, -len(self.drafts) - 1 :]
        round_: Verified = await self.services.heads.score(
            scored, verify, self.sampler, self.request.adapter, positions=True
        )
        self._keep(round_.path)
        # A draft model: k forwards in a thread of its own, unless the frame sent ahead is this round's step (its
        # drafts were made as it left; drafting again would cost k forwards for nothing).
        fed = round_.tokens[-1].token_id
        if self.plan.threaded and k > 0 and not round_.done and not self._ahead_fits(len(self.kept), fed):
            round_ = await asyncio.to_thread(with_drafts, round_, self.plan, k, self.services.embed, self.trees)
        if self.sampler.constraint is not None:
            self.sampler.constraint.prefetch()  # the next mask computes while the nodes run this token
        depth = len(self.drafts) if self.parents is None else DraftTree(self.drafts, self.parents).depth()
        self.plan.verified(depth, round_.accepted, self.forced)
        return round_

    def _keep(self, path: list[int]) -> None:
        """What the nodes keep of the last step: its first token and the drafts on ``path``; ``branch`` names their
        slots from the first that is not already in place (None: the kept ones are the step's first slots)."""
        slots = [self.base, *(self.base + 1 + node for node in path)]
        self.kept = self.held[: self.base] + [self.held[slot] for slot in slots]
        moved = next((index for index, slot in enumerate(slots) if slot != self.base + index), None)
        self.branch = None if moved is None else slots[moved:]

    async def advance(self, round_: Verified) -> None:
        """One traversal of the chain: the round's last token and its drafts, at the first position not kept (the
        frame sent ahead a round ago instead, when its guess held)."""
        position = len(self.kept)
        fed = round_.tokens[-1].token_id
        ahead = self._take_ahead(position, fed)
        if ahead is not None:  # its guess held: the round kept every draft before it and emitted its first token
            drafts, parents, forced = ahead.tokens[1:], None, 0
            self._output = await self._through_frames(ahead)
        else:
            drafts, parents, forced = round_.drafts, round_.parents, round_.forced
            self._output = await self._stepped(round_, position)
        self.held = self.kept + [fed, *drafts]
        self.base, self.kept, self.branch = position, list(self.held), None
        self.drafts, self.parents, self.forced = drafts, parents, forced

    async def _stepped(self, round_: Verified, position: int) -> torch.Tensor:
        """The round's step: as a frame when this round pipelines (a chain of drafts, no tree branch to move),
        else awaited as one step (timed for the tuner: a frame's time overlaps the frame before it)."""
        assert round_.hidden is not None
        chain = self._chain
        tokens = [round_.tokens[-1].token_id, *round_.drafts]
        if self.plan.pipelined and round_.parents is None and self.branch is None and isinstance(chain, FrameChain):
            frame = chain.frame(round_.hidden, position)
            return await self._through_frames(Ahead(frame, round_.hidden, tokens, position))
        relay_rtt, plain_rtt = self._round_trips()
        started = time.monotonic()
        output = await self._step(round_.hidden, position, round_.parents)  # [1, 1 + k, D]
        self.plan.stepped(time.monotonic() - started, relay_rtt if round_.drafts else plain_rtt)
        return output

    async def _through_frames(self, sent: Ahead) -> torch.Tensor:
        """``sent``'s output, the next frame sent ahead of it first while the round pipelines; a frame that failed
        is sent again as an ordinary step (which waits for the frames to stop, and fails over)."""
        if self.plan.pipelined:
            self.ahead = await self._send_ahead(sent)
        output = await sent.frame.output()
        if output is None:
            self._void_ahead()
            output = await self._step(sent.hidden, sent.position, None)
        return output

    async def _send_ahead(self, sent: Ahead) -> Ahead | None:
        """A frame after ``sent`` on the guess that ``sent`` is kept whole: its bonus token guessed, drafts after."""
        chain = self._chain
        assert isinstance(chain, FrameChain)
        tokens, hidden = await asyncio.to_thread(self._ahead_inputs, sent.tokens[1:])
        if hidden is None:
            return None
        position = sent.position + len(sent.tokens)
        self._sent_end = max(self._sent_end, position + len(tokens))
        return Ahead(chain.frame(hidden, position, ahead=True), hidden, tokens, position)

    def _ahead_inputs(self, drafts: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """(a frame ahead's tokens, their embeddings [1, T, D]) after a frame carrying ``drafts``; none near the end."""
        tokens = self.plan.propose_ahead(drafts, self._k)
        return tokens, self.services.embed(tokens) if tokens else None

    def _ahead_fits(self, position: int, fed: int) -> bool:
        """Whether the frame sent ahead is the step this round needs: at ``position``, fed ``fed``, no branch moved."""
        ahead = self.ahead
        return ahead is not None and ahead.position == position and ahead.tokens[0] == fed and self.branch is None

    def _take_ahead(self, position: int, fed: int) -> Ahead | None:
        """The frame sent ahead if it is the step this round needs (``_ahead_fits``); else it is voided."""
        fits, ahead, self.ahead = self._ahead_fits(position, fed), self.ahead, None
        if ahead is None or fits:
            return ahead
        ahead.frame.void()
        return None

    def _void_ahead(self) -> None:
        if self.ahead is not None:
            self.ahead.frame.void()
            self.ahead = None

    async def finish(self) -> None:
        """A generation that ended well keeps its chain for the conversation's next turn (rolled back to the tokens
        it kept); any other closes it."""
        chain, keep = self._chain, self.services.keep
        self._void_ahead()  # the chain waits for it to stop before it rolls back or closes
        if chain is None:
            return
        if not self._ended_well or keep is None:
            await chain.close()
            return
        kept = self.kept
        held = max(len(self.held), self._sent_end)
        if len(kept) < held and not await _rolled_back(chain, len(kept), self.branch):
            return
        await keep(kept, chain)

    def _next_k(self) -> int:
        """Drafts to propose after this round. Other generations here now count (decoding, or still prefilling:
        streams started together are about to form a batch): a verify step rides in their batched node forwards,
        and its extra positions delay their rows too."""
        relay_rtt, plain_rtt = self._round_trips()
        frame = self.services.frame_rtt(self._chain) if self.services.frame_rtt is not None else None
        return self.plan.next_k(relay_rtt, self.services.others(), plain_rtt, frame)

    def _round_trips(self) -> tuple[float, float]:
        assert self._chain is not None
        return self.services.round_trips(self._chain)

    async def _step(self, hidden: torch.Tensor | None, position: int, parents: list[int] | None) -> torch.Tensor:
        """One step at ``position``: a tree step (``parents``) or one after a tree step whose kept branch moves
        (``branch``) needs a ``TreeChain``; any other step goes to a plain one."""
        assert self._chain is not None and hidden is not None
        if parents is None and self.branch is None:
            return await self._chain.step(hidden, position)
        tree = None if parents is None else DraftTree([0] * len(parents), parents).step_parents()
        return await cast(TreeChain, self._chain).step(hidden, position, tree, self.branch)


async def _rolled_back(chain: Chain, length: int, branch: list[int] | None) -> bool:
    """The nodes rolled back to ``length`` tokens (rejected drafts past it dropped, a kept tree branch moved into
    place); False with the chain closed."""
    try:
        if branch is None:
            await chain.truncate(length)
        else:
            await cast(TreeChain, chain).truncate(length, branch)
    except Exception as error:
        logger.info("closing a chain that could not roll back its drafts: %s", error)
        await chain.close()
        return False
    return True
