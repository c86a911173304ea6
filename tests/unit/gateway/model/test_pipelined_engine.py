"""Pipelined verification in the engine's decode loop, over an in-process chain of spans that takes frames.

The chain (``FramedChain``) runs a frame's spans only when its turn comes, in the order frames were sent, as a
node serves its stream; with ``lazy`` frames stay in flight until the generation awaits them (a long round trip),
so a frame sent ahead is certainly sent before the one before it returns. It records every frame's overlap and
order. Checked: greedy output (with logprobs) and seeded sampling with penalties equal plain decoding with frames
sent ahead and some of them voided by rejected drafts; a void frame sends nothing; a frame that fails is stepped
again unpipelined; the nodes are rolled back past what a void frame wrote.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from gateway.generation import GeneratedToken, GenerationRequest, SamplingParams
from gateway.model.draft_model import DraftModel, DraftSession
from gateway.model.engine import GenerationEngine
from gateway.model.speculation import PromptLookup, SpecTuner
from gateway.settings import EngineSettings
from tests.helpers.kept_chats import ended_chats, keeping_chats, plain_reference
from tests.tiny_models import GetTinyModel
from tests.unit.gateway.model.test_speculative_engine import (
    NEW_TOKENS,
    PROMPT,
    LocalChain,
    LocalEngine,
    OracleDrafts,
    local_engine,
    run,
)
from tests.unit.swarm_node.test_span_exactness import Chain, build_chain

K = 3  # drafts per frame: the oracle's every fifth wrong draft falls in about every other frame


class FakeFrame:
    """A frame on ``FramedChain``: computed after the frame before it (whatever became of that one)."""

    def __init__(self, chain: FramedChain, hidden: torch.Tensor, position: int, before: FakeFrame | None) -> None:
        self.chain, self.hidden, self.position, self.before = chain, hidden, position, before
        self.voided = False
        self.index = chain.sent  # frames sent on this chain before it
        self.released = asyncio.Event()  # lazy frames: the generation asked for the output
        if not chain.lazy:
            self.released.set()
        self.task = asyncio.create_task(self._run())

    def void(self) -> None:
        self.voided = True
        self.released.set()

    async def output(self) -> torch.Tensor | None:
        self.released.set()
        return await asyncio.shield(self.task)

    async def _run(self) -> torch.Tensor | None:
        if self.before is not None:
            await asyncio.wait([self.before.task])  # the node's stream: one message after another
        await self.released.wait()
        await asyncio.sleep(0)
        if self.voided:
            self.chain.log.append(("void", self.position))
            return None
        if self.index in self.chain.fail_at:
            self.chain.log.append(("failed", self.position))
            return None
        self.chain.log.append(("frame", self.position))
        return self.chain.compute(self.hidden, self.position)


class FramedChain(LocalChain):
    """``LocalChain`` that also takes frames; an ordinary step or a roll-back waits for them to stop first."""

    def __init__(self, chain: Chain, lazy: bool, fail_at: set[int]) -> None:
        super().__init__(chain)
        self.lazy = lazy
        self.fail_at = fail_at  # frames (by send order) that fail, as a frame meeting a dead node does
        self.frames: list[FakeFrame] = []
        self.log: list[tuple[str, int]] = []  # ("frame" | "void" | "failed" | "step", position), in order
        self.sent = 0
        self.overlaps: list[int] = []  # frames still in flight as each frame is sent (itself included)

    def frame(self, hidden: torch.Tensor, position: int, ahead: bool = False) -> FakeFrame:
        before = self.frames[-1] if self.frames else None
        frame = FakeFrame(self, hidden, position, before)
        self.frames.append(frame)
        self.sent += 1
        self.overlaps.append(sum(not f.task.done() for f in self.frames))
        return frame

    def compute(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        with torch.inference_mode():
            for span, kv in zip(self._chain.spans, self._kvs, strict=True):
                hidden = span(hidden, [kv], [position], range(span.start, span.end))
            return hidden

    async def _settle(self) -> None:
        for frame in self.frames:
            frame.void()
        await asyncio.gather(*(frame.task for frame in self.frames))
        self.frames = []

    async def step(
        self, hidden: torch.Tensor, position: int, tree: list[int] | None = None, branch: list[int] | None = None
    ) -> torch.Tensor:
        await self._settle()
        self.log.append(("step", position))
        return await super().step(hidden, position, tree, branch)

    async def truncate(self, length: int, branch: list[int] | None = None) -> None:
        await self._settle()
        await super().truncate(length, branch)


class AlwaysPipelined(SpecTuner):
    """A tuner that pipelines every round with ``K`` drafts (the cost model's choice is tested on its own)."""

    def next_k(
        self,
        rtt: float,
        limit: int,
        plain_rtt: float | None = None,
        batch_rows: int = 0,
        frame_rtt: float | None = None,
        hops: int = 1,
    ) -> int:
        self.pipelined = True
        return min(K, max(0, limit))


class FramedEngine(LocalEngine):
    def __init__(
        self, settings: EngineSettings, chain: Chain, oracle: list[int], lazy: bool, fail_at: set[int]
    ) -> None:
        super().__init__(settings, chain, oracle)
        self.lazy, self.fail_at = lazy, fail_at

    def _drafter(self, request: GenerationRequest) -> PromptLookup | None:
        assert self._oracle is not None
        return OracleDrafts(request.prompt_ids, AlwaysPipelined(K, 0.0), self._oracle)

    async def _prefill(self, request: GenerationRequest) -> tuple[FramedChain, torch.Tensor, int]:  # type: ignore[override]
        chain = FramedChain(self.local, self.lazy, self.fail_at)
        self.chains.append(chain)
        return chain, await chain.step(self._embed(request.prompt_ids), 0), 0

    def _relay_rtt(self, chain: object) -> tuple[float, int]:  # type: ignore[override]
        return self.rtt, 1


def framed_engine(
    folder: Path, chain: Chain, oracle: list[int], lazy: bool, fail_at: set[int] | None = None
) -> FramedEngine:
    base = local_engine(folder, chain, "ngram")
    return FramedEngine(base.settings, chain, oracle, lazy, fail_at or set())


async def plain_then_pipelined(
    tiny_model: GetTinyModel, request: GenerationRequest, lazy: bool, fail_at: set[int] | None = None
) -> tuple[list[GeneratedToken], list[GeneratedToken], FramedChain]:
    tiny = tiny_model("llama")
    chain = build_chain(tiny.folder, (2, 4))
    plain_engine: GenerationEngine = local_engine(tiny.folder, chain, "off")
    try:
        plain = await run(plain_engine, request)  # type: ignore[arg-type]
    finally:
        await plain_engine.heads.close()
    engine = framed_engine(tiny.folder, chain, [t.token_id for t in plain], lazy, fail_at)
    try:
        piped = await run(engine, request)
    finally:
        await engine.heads.close()
    framed = engine.chains[0]
    assert isinstance(framed, FramedChain)
    return plain, piped, framed


@pytest.mark.parametrize("lazy", [True, False], ids=["in-flight-until-awaited", "computed-at-once"])
async def test_greedy_with_frames_ahead_equals_plain_decoding(tiny_model: GetTinyModel, lazy: bool) -> None:
    request = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0), logprobs=2)
    plain, piped, chain = await plain_then_pipelined(tiny_model, request, lazy)
    assert [t.token_id for t in piped] == [t.token_id for t in plain]
    for got, want in zip(piped, plain, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    kinds = [kind for kind, _ in chain.log]
    assert kinds.count("frame") > 2  # frames ran
    if lazy:
        assert "void" in kinds  # a rejection voided a frame sent ahead before it ran
        assert max(chain.overlaps) == 2  # a frame left while the one before it was still in flight
    else:  # frames ahead that ran on a wrong guess: a later step rewound over them
        positions = [position for _, position in chain.log]
        assert any(later < earlier for earlier, later in zip(positions, positions[1:], strict=False))


async def test_a_rejection_voids_the_frame_ahead_and_the_next_frame_rewinds(tiny_model: GetTinyModel) -> None:
    request = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0))
    plain, piped, chain = await plain_then_pipelined(tiny_model, request, lazy=True)
    assert [t.token_id for t in piped] == [t.token_id for t in plain]
    for index, (kind, position) in enumerate(chain.log):
        if kind == "void":  # the frame after it goes back to the first position not kept
            after = next(p for k, p in chain.log[index + 1 :] if k in ("frame", "step"))
            assert after <= position  # equal: every draft kept, the bonus guessed wrong


async def test_seeded_sampling_with_penalties_is_the_same_with_frames_ahead(tiny_model: GetTinyModel) -> None:
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=11, presence_penalty=0.3, repetition_penalty=1.1)
    plain, piped, chain = await plain_then_pipelined(tiny_model, GenerationRequest(PROMPT, NEW_TOKENS, params), True)
    assert [t.token_id for t in piped] == [t.token_id for t in plain]
    assert [kind for kind, _ in chain.log].count("frame") > 2


async def test_a_frame_that_fails_is_stepped_again_unpipelined(tiny_model: GetTinyModel) -> None:
    request = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0))
    plain, piped, chain = await plain_then_pipelined(tiny_model, request, lazy=True, fail_at={0, 3, 4, 7, 8, 11})
    assert [t.token_id for t in piped] == [t.token_id for t in plain]
    failures = [index for index, (kind, _) in enumerate(chain.log) if kind == "failed"]
    assert failures
    for index in failures:  # the same position goes again as an ordinary step (which fails over on a real chain)
        following = [entry for entry in chain.log[index + 1 :] if entry[0] != "void"]  # frames ahead of it: void
        assert following[0] == ("step", chain.log[index][1])


async def test_a_kept_conversation_is_rolled_back_past_what_frames_ahead_wrote(tiny_model: GetTinyModel) -> None:
    """A chat kept for its next turn holds exactly its tokens on every hop, also where a frame sent ahead (voided,
    or past the end-of-sequence token) wrote further: else its shrink would be refused and the conversation lost."""
    tiny = tiny_model("llama")
    chain = build_chain(tiny.folder, (3,))
    plain_engine = local_engine(tiny.folder, chain, "off")
    reference = await plain_reference(plain_engine, PROMPT, 30)
    async with keeping_chats(framed_engine(tiny.folder, chain, reference, lazy=False)) as engine:
        async for chat in ended_chats(engine, PROMPT, reference):  # frames ahead wrote past the end-of-sequence token
            held = len(chat.kept.token_ids)
            assert chat.chain.lengths == {held} and chat.chain.max_length == held and not chat.chain.closed
        assert any(local.truncated for local in engine.chains)


class CountedDrafts(DraftSession):
    """A draft model's session that counts its proposals (each one runs the draft model's forwards)."""

    proposals = 0

    def propose(self, k: int, after: Sequence[int] = (), forced: int = 0) -> list[int]:
        self.proposals += 1
        return super().propose(k, after, forced)


class PricedPipelined(AlwaysPipelined):
    """``AlwaysPipelined`` that counts the proposals priced for it (``record_draft`` with tokens drafted)."""

    priced = 0

    def record_draft(self, seconds: float, drafted: int) -> None:
        self.priced += drafted > 0
        super().record_draft(seconds, drafted)


class DraftFramedEngine(FramedEngine):
    """Frames ahead drafted by a draft model (the served model itself: every frame ahead is right)."""

    def __init__(self, settings: EngineSettings, chain: Chain, draft: DraftModel) -> None:
        super().__init__(settings, chain, [], lazy=True, fail_at=set())
        self.draft = draft
        self.drafters: list[CountedDrafts] = []

    def _drafter(self, request: GenerationRequest) -> CountedDrafts:  # type: ignore[override]
        self.drafters.append(CountedDrafts(self.draft.model, request.prompt_ids, PricedPipelined(K, 0.0)))
        return self.drafters[-1]


async def test_a_draft_model_drafts_each_frame_ahead_once_while_the_frame_before_travels(
    tiny_model: GetTinyModel,
) -> None:
    """Greedy with a draft model and frames ahead is plain decoding; each frame ahead is drafted as it leaves, while
    the frame before it is in flight, and a round whose frame ahead holds drafts nothing more (a draft model's
    proposal is k forwards: drafting the round's own step too would double them)."""
    tiny = tiny_model("llama")
    chain = build_chain(tiny.folder, (2, 4))
    request = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0), logprobs=1)
    plain_engine = local_engine(tiny.folder, chain, "off")
    try:
        plain = await run(plain_engine, request)
    finally:
        await plain_engine.heads.close()
    draft = DraftModel.load(str(tiny.folder), plain_engine.tokenizer)
    engine = DraftFramedEngine(local_engine(tiny.folder, chain, "ngram").settings, chain, draft)
    try:
        piped = await run(engine, request)
    finally:
        await engine.heads.close()
    assert [t.token_id for t in piped] == [t.token_id for t in plain]
    framed = engine.chains[0]
    assert isinstance(framed, FramedChain)
    frames = [kind for kind, _ in framed.log].count("frame")
    assert frames > 5 and max(framed.overlaps) == 2  # frames left while the one before them was in flight
    drafter = engine.drafters[0]
    assert drafter.proposals <= frames + 2  # one proposal a frame: none for rounds a frame ahead held
    assert isinstance(drafter.tuner, PricedPipelined)
    assert drafter.tuner.priced >= drafter.proposals - 1  # a frame ahead's drafting is timed for the cost model too
