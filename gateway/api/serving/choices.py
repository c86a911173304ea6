"""Running a request's choices: each its own engine stream (its own node sessions), all concurrently.

    run_choice: engine.stream ─TextAssembler→ ChoiceEvent(index, Piece | PromptScores) … last Piece has finish_reason
    merge:      n choices → one stream of their events, in arrival order

A choice that meets a stop string closes its engine stream at once, which closes its node sessions; leaving
``merge`` early (a disconnect, an error) cancels every choice still running, with the same effect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from gateway.generation import Engine, GenerationRequest, PromptCached, PromptScores
from gateway.metrics import current_timer
from gateway.text.assembler import Piece, TextAssembler
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopMatcher

T = TypeVar("T")


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    request: GenerationRequest
    stops: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChoiceEvent:
    index: int
    payload: Piece | PromptScores
    generated: int = 0  # on a choice's last piece: tokens the engine produced (EOS included)
    logprob_sum: float = 0.0  # on the last piece: summed logprobs of its returned tokens
    cached_tokens: int = 0  # on the last piece: prompt tokens the nodes held from an earlier turn (not prefilled)


async def run_choice(engine: Engine, spec: ChoiceSpec) -> AsyncIterator[ChoiceEvent]:
    detokenizer = IncrementalDetokenizer(engine.codec, spec.request.prompt_ids)
    assembler = TextAssembler(detokenizer, StopMatcher(spec.stops), spec.request.ignore_eos)
    timer = current_timer()
    cached, after_eos = 0, False
    async with contextlib.aclosing(engine.stream(spec.request)) as events:
        async for event in events:
            if isinstance(event, PromptCached):
                cached = event.tokens
                continue
            if isinstance(event, PromptScores):
                yield ChoiceEvent(spec.index, event)
                continue
            if after_eos:
                break  # the engine went on after an EOS after all: end it here
            if timer is not None:
                timer.token(spec.index)
            piece = assembler.add(event)
            if piece:
                yield ChoiceEvent(spec.index, piece)
            if assembler.stopped:
                # After an EOS the engine ends by itself, and a natural end keeps a chat's node caches for its next
                # turn; anything else (a stop string) ends it here. With ignore_eos only a stop string gets here.
                if not event.eos or spec.request.ignore_eos:
                    break  # leaving the ``aclosing`` block ends the generation and its node sessions now
                after_eos = True
    last = assembler.finish()
    if timer is not None and last.finish_reason is not None:
        timer.choice_finished(last.finish_reason)
    yield ChoiceEvent(spec.index, last, assembler.generated, assembler.logprob_sum, cached)


class _Done:
    pass


@dataclass(frozen=True)
class _Failed:
    error: Exception


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of all ``streams`` as they arrive; the first failure is raised and cancels the rest."""
    queue: asyncio.Queue[T | _Done | _Failed] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as error:
            queue.put_nowait(_Failed(error))
        else:
            queue.put_nowait(_Done())
        finally:
            await _aclose(stream)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, _Failed):
                raise item.error
            if isinstance(item, _Done):
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # each choice's own ``finally`` closes its node sessions (shielded)
        await asyncio.gather(*tasks, return_exceptions=True)


async def prime(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Fetch the first item now — so that failing to start (no route, no room) is a plain HTTP error, not a
    stream error — and return the whole stream, that item first."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return _chain([], stream)
    except BaseException:
        await _aclose(stream)
        raise
    return _chain([first], stream)


async def _chain(head: list[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        for item in head:
            yield item
        async for item in rest:
            yield item
    finally:
        await _aclose(rest)


async def _aclose(stream: AsyncIterator[T]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
