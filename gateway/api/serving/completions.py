"""/v1/completions: prompts (text or token ids, one or many) × n choices, each its own generation.

Choice ``i`` of prompt ``p`` has index ``p * n + i`` and seed ``seed + i``. With ``best_of > n`` the server runs
``best_of`` generations per prompt and returns the ``n`` with the highest mean token logprob (never streamed).
Logprob ``text_offset``s count from the start of the prompt, echoed or not, as OpenAI's do.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from gateway.api.errors import InvalidRequest
from gateway.api.protocol.common import Usage, reject_unsupported
from gateway.api.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from gateway.api.protocol.completions import (
    Prompt as PromptInput,
)
from gateway.api.request_log import RequestRecord
from gateway.api.serving.choices import ChoiceEvent, ChoiceSpec
from gateway.api.serving.common import (
    ChoiceResult,
    RequestContext,
    ServingBase,
    Stream,
    new_id,
    token_string,
)
from gateway.generation import GenerationRequest, PromptScores
from gateway.text.assembler import EmittedToken
from gateway.text.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # what echo returns and text offsets count from
    offsets: list[int]  # where each prompt token's text starts in ``text``


class CompletionServing(ServingBase):
    async def create(self, body: CompletionRequest, context: RequestContext) -> CompletionResponse | Stream:
        adapter = await self.resolve_model(body.model)
        reject_unsupported(body)
        n, best_of = self._choice_counts(body)
        prompts = await self._prompts(body)
        budgets = [self.completion_budget(len(p.ids), body.max_tokens, "max_tokens") for p in prompts]
        specs = self.with_adapter(self._specs(body, prompts, budgets, best_of), adapter)
        record = RequestRecord(new_id("cmpl"), "completions", len(specs), sum(len(p.ids) for p in prompts))
        if body.stream:
            return await self.run_streamed(
                record, specs, context, lambda events: self._chunks(body, record, prompts, events)
            )
        results = await self.run_collected(record, specs, context)
        return self._response(body, record, prompts, results, n, best_of)

    def _choice_counts(self, body: CompletionRequest) -> tuple[int, int]:
        n = body.n or 1
        best_of = body.best_of or n
        if best_of < n:
            raise InvalidRequest("best_of must be greater than or equal to n.", "invalid_value", "best_of")
        if body.stream and best_of > n:
            raise InvalidRequest("best_of cannot be streamed: set stream to false.", "invalid_value", "best_of")
        return n, best_of

    async def _prompts(self, body: CompletionRequest) -> list[Prompt]:
        items = prompt_items(body.prompt)
        if not items:
            raise InvalidRequest("The prompt is empty.", "invalid_value", "prompt")
        needs_text = bool(body.echo) or body.logprobs is not None
        return [await self._prompt(item, body.suffix, needs_text) for item in items]

    async def _prompt(self, item: str | list[int], suffix: str | None, needs_text: bool) -> Prompt:
        ids = await self.encode(item) if isinstance(item, str) else list(item)
        self.check_token_ids(ids, "prompt")
        if suffix:
            ids = await self._fill_in_the_middle(ids, suffix)
        if not needs_text:
            return Prompt(ids, "", [])
        text, offsets = await asyncio.to_thread(self._prompt_text, ids)
        if isinstance(item, str) and not suffix:
            text = item  # echo gives back exactly what was sent
        return Prompt(ids, text, offsets)

    async def _fill_in_the_middle(self, ids: list[int], suffix: str) -> list[int]:
        fim = self.engine.codec.fim_ids()
        if fim is None:
            raise InvalidRequest(
                f"suffix is not supported: {self.config.model_name} has no fill-in-the-middle tokens.",
                "unsupported_value",
                "suffix",
            )
        prefix_id, suffix_id, middle_id = fim
        suffix_ids = await self.encode(suffix, add_special_tokens=False)
        return [prefix_id, *ids, suffix_id, *suffix_ids, middle_id]

    def _prompt_text(self, ids: list[int]) -> tuple[str, list[int]]:
        detokenizer = IncrementalDetokenizer(self.engine.codec)
        text, offsets = "", []
        for token in ids:
            offsets.append(len(text))
            text += detokenizer.push(token)
        return text + detokenizer.flush(), offsets

    def _specs(
        self, body: CompletionRequest, prompts: list[Prompt], budgets: list[int], best_of: int
    ) -> list[ChoiceSpec]:
        sampling = self.sampling_params(body)
        n = body.n or 1
        # Ranking best_of candidates needs their logprobs even when the client did not ask for them.
        logprobs = body.logprobs if body.logprobs is not None or best_of == n else 0
        specs = []
        for p, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            for i in range(best_of):
                seed = None if sampling.seed is None else sampling.seed + i
                request = GenerationRequest(
                    prompt.ids,
                    budget,
                    sampling.with_seed(seed),
                    ignore_eos=bool(body.ignore_eos),
                    logprobs=logprobs,
                    prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                )
                specs.append(ChoiceSpec(p * best_of + i, request, tuple(body.stop_list())))
        return specs

    def _response(
        self,
        body: CompletionRequest,
        record: RequestRecord,
        prompts: list[Prompt],
        results: list[ChoiceResult],
        n: int,
        best_of: int,
    ) -> CompletionResponse:
        choices = []
        for p, prompt in enumerate(prompts):
            candidates = results[p * best_of : (p + 1) * best_of]
            if best_of > n:
                candidates = sorted(candidates, key=lambda r: r.mean_logprob, reverse=True)[:n]
            for rank, result in enumerate(candidates):
                choices.append(self._choice(body, prompt, result, p * n + rank))
        usage = Usage.of(record.prompt_tokens, record.completion_tokens)
        return CompletionResponse(id=record.id, created=record.created, model=body.model, choices=choices, usage=usage)

    def _choice(self, body: CompletionRequest, prompt: Prompt, result: ChoiceResult, index: int) -> CompletionChoice:
        text = (prompt.text if body.echo else "") + result.text
        logprobs = None
        if body.logprobs is not None:
            logprobs = self._echo_logprobs(prompt, result.prompt) if body.echo else CompletionLogprobs()
            logprobs.extend(self._token_logprobs(result.tokens, len(prompt.text)))
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=result.finish_reason)

    def _echo_logprobs(self, prompt: Prompt, scores: PromptScores | None) -> CompletionLogprobs:
        codec = self.engine.codec
        tokens = [token_string(codec.token_bytes(t)) for t in prompt.ids]
        if scores is None:
            none: list[None] = [None] * len(tokens)
            return CompletionLogprobs(tokens=tokens, token_logprobs=none, top_logprobs=none, text_offset=prompt.offsets)
        tops: list[dict[str, float] | None] = []
        for token, logprob, top in zip(prompt.ids, scores.logprobs, scores.top, strict=True):
            tops.append(None if top is None or logprob is None else self._top_dict(token, logprob, top))
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=scores.logprobs, top_logprobs=tops, text_offset=prompt.offsets
        )

    def _token_logprobs(self, tokens: list[EmittedToken] | tuple[EmittedToken, ...], base: int) -> CompletionLogprobs:
        codec = self.engine.codec
        result = CompletionLogprobs()
        for emitted in tokens:
            token = emitted.token
            logprob = token.logprob if token.logprob is not None else 0.0
            result.tokens.append(token_string(codec.token_bytes(token.token_id)))
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(self._top_dict(token.token_id, logprob, token.top))
            result.text_offset.append(base + emitted.offset)
        return result

    def _top_dict(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        """OpenAI's top_logprobs entry: the most likely tokens, and always the chosen one."""
        codec = self.engine.codec
        entries = {token_string(codec.token_bytes(t)): lp for t, lp in top}
        entries.setdefault(token_string(codec.token_bytes(token)), logprob)
        return entries

    async def _chunks(
        self, body: CompletionRequest, record: RequestRecord, prompts: list[Prompt], events: AsyncIterator[ChoiceEvent]
    ) -> AsyncGenerator[str, None]:
        n = body.n or 1
        started: set[int] = set()
        async with record.tracking(), contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                prompt = prompts[event.index // n]
                if event.index not in started:
                    started.add(event.index)
                    if body.echo:
                        yield self._chunk(body, record, self._echo_choice(body, prompt, event))
                if isinstance(event.payload, PromptScores):
                    continue
                piece = event.payload
                if piece.text or piece.tokens:
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self._token_logprobs(piece.tokens, len(prompt.text))
                    choice = CompletionChoice(index=event.index, text=piece.text, logprobs=logprobs)
                    yield self._chunk(body, record, choice)
                if piece.finish_reason is not None:
                    record.completion_tokens += event.generated
                    record.finish_reason = piece.finish_reason
                    choice = CompletionChoice(index=event.index, text="", finish_reason=piece.finish_reason)
                    yield self._chunk(body, record, choice)
            if body.include_usage():
                usage = Usage.of(record.prompt_tokens, record.completion_tokens)
                last = CompletionResponse(
                    id=record.id, created=record.created, model=body.model, choices=[], usage=usage
                )
                yield last.model_dump_json()

    def _echo_choice(self, body: CompletionRequest, prompt: Prompt, event: ChoiceEvent) -> CompletionChoice:
        logprobs = None
        if body.logprobs is not None:
            scores = event.payload if isinstance(event.payload, PromptScores) else None
            logprobs = self._echo_logprobs(prompt, scores)
        return CompletionChoice(index=event.index, text=prompt.text, logprobs=logprobs)

    def _chunk(self, body: CompletionRequest, record: RequestRecord, choice: CompletionChoice) -> str:
        chunk = CompletionResponse(id=record.id, created=record.created, model=body.model, choices=[choice])
        # OpenAI sends "usage": null on every chunk only when the client asked for the usage chunk.
        return chunk.model_dump_json(exclude=None if body.include_usage() else {"usage"})


def prompt_items(prompt: PromptInput) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of prompts: str, list[str], list[int], list[list[int]]."""
    if isinstance(prompt, str):
        return [prompt]
    items: list[str | list[int]] = []
    single: list[int] = []
    for item in prompt:
        if isinstance(item, int):
            single.append(item)  # one prompt given as token ids
        else:
            items.append(item)
    return [single] if single else items
