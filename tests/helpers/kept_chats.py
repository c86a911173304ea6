"""Chats ended amid a speculative round and kept for their next turn: the loop the engine's kept-conversation tests
(plain, pipelined and tree speculation) share; each then checks what the chat's chain holds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from gateway.generation import GeneratedToken, GenerationRequest, SamplingParams
from gateway.swarm.conversations import Kept
from gateway.swarm.kept_chains import KeptChains, Parked
from gateway.swarm.view import SwarmView

if TYPE_CHECKING:  # a test module (which imports this one): for annotations only
    from tests.unit.gateway.model.test_speculative_engine import LocalChain, LocalEngine

Engine = TypeVar("Engine", bound="LocalEngine")


async def token_ids(engine: LocalEngine, request: GenerationRequest) -> list[int]:
    return [event.token_id async for event in engine.stream(request) if isinstance(event, GeneratedToken)]


async def plain_reference(engine: LocalEngine, prompt: list[int], new_tokens: int) -> list[int]:
    """The greedy tokens of an engine that does not speculate; its heads are closed after."""
    try:
        return await token_ids(engine, GenerationRequest(prompt, new_tokens, SamplingParams(0.0)))
    finally:
        await engine.heads.close()


@dataclass
class EndedChat:
    expected: list[int]  # the tokens it gave: the reference up to and with its end-of-sequence token
    chain: LocalChain
    kept: Kept[Parked]  # what the pool holds for the chat's next turn, shrunk to its tokens


async def _no_view() -> SwarmView:
    raise AssertionError("the sweeper is not started in these tests")


@asynccontextmanager
async def keeping_chats(engine: Engine) -> AsyncIterator[Engine]:
    """The engine keeping chats for their next turn (its sweeper not started); its pool and heads closed after."""
    engine._kept = KeptChains(_no_view, keep_alive=60.0, max_kept=64)
    try:
        yield engine
    finally:
        await engine.kept.close()
        await engine.heads.close()


async def ended_chats(engine: LocalEngine, prompt: list[int], reference: list[int]) -> AsyncIterator[EndedChat]:
    """One chat a token of ``reference`` from the 9th to the 20th, made its end-of-sequence token: an end amid a
    round's drafts, whose drafts after it (or frames sent ahead) wrote past it. Each gives the reference up to it."""
    for end in range(8, 20):
        engine.stop_ids = {reference[end]}
        expected = reference[: reference.index(reference[end]) + 1]
        request = GenerationRequest(prompt, len(reference), SamplingParams(0.0), reuse_scope=f"chat{end}")
        assert await token_ids(engine, request) == expected
        chain, kept = engine.chains[-1], engine.kept.pool._kept[-1]
        assert kept.scope == f"chat{end}" and kept.item.chain is chain
        await kept.item.shrunk
        yield EndedChat(expected, chain, kept)
