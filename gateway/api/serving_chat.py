"""/v1/chat/completions: messages rendered with the model's own chat template, n choices, OpenAI's chunk shape.

A stream sends, per choice, a first delta with the role, content deltas (with their logprobs), and a last empty
delta carrying ``finish_reason``; then the usage chunk when asked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from gateway.api.assembler import EmittedToken, FinishReason
from gateway.api.choices import ChoiceEvent, ChoiceSpec
from gateway.api.errors import InvalidRequest
from gateway.api.protocol import Usage
from gateway.api.protocol_chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    Delta,
    TokenLogprob,
    TopLogprob,
)
from gateway.api.request_log import RequestRecord
from gateway.api.serving_common import RequestContext, ServingBase, Stream, new_id, token_string
from gateway.generation import GenerationRequest, PromptScores


class ChatServing(ServingBase):
    async def create(self, body: ChatCompletionRequest, context: RequestContext) -> ChatCompletionResponse | Stream:
        self.check_model(body.model)
        self._check_options(body)
        prompt_ids = await self.prompt_ids(body.messages)
        budget = self.completion_budget(len(prompt_ids), body.max_completion_tokens or body.max_tokens, "messages")
        specs = self._specs(body, prompt_ids, budget, reuse_scope=context.caller.scope)
        record = RequestRecord(new_id("chatcmpl"), "chat", len(specs), len(prompt_ids))
        if body.stream:
            return await self.run_streamed(record, specs, context, lambda events: self._chunks(body, record, events))
        results = await self.run_collected(record, specs, context)
        choices = [
            ChatChoice(
                index=result.index,
                message=AssistantMessage(content=result.text),
                logprobs=self._logprobs(body, result.tokens),
                finish_reason=result.finish_reason,
            )
            for result in results
        ]
        usage = Usage.of(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
        return ChatCompletionResponse(id=record.id, model=self.config.model_name, choices=choices, usage=usage)

    async def prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        rendered = await asyncio.to_thread(self.engine.codec.render_chat, [template_message(m) for m in messages])
        # The template already wrote the special tokens (BOS, role markers): encode it as is.
        ids = await self.encode(rendered, add_special_tokens=False)
        self.check_token_ids(ids, "messages")
        return ids

    def _check_options(self, body: ChatCompletionRequest) -> None:
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true.", "invalid_value", "top_logprobs")
        if body.response_format is not None and body.response_format.type != "text":
            raise InvalidRequest(
                f"response_format {body.response_format.type!r} is not supported; only 'text' is.",
                "unsupported_value",
                "response_format",
            )

    def _specs(
        self, body: ChatCompletionRequest, prompt_ids: list[int], budget: int, reuse_scope: str | None
    ) -> list[ChoiceSpec]:
        """``reuse_scope``: whose conversation (an API key's id); one choice only may keep or reuse node caches."""
        sampling = self.sampling_params(body)
        scope = reuse_scope if (body.n or 1) == 1 else None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        specs = []
        for i in range(body.n or 1):
            seed = None if sampling.seed is None else sampling.seed + i
            request = GenerationRequest(
                prompt_ids,
                budget,
                sampling.with_seed(seed),
                ignore_eos=bool(body.ignore_eos),
                logprobs=logprobs,
                reuse_scope=scope,
            )
            specs.append(ChoiceSpec(i, request, tuple(body.stop_list())))
        return specs

    async def _chunks(
        self, body: ChatCompletionRequest, record: RequestRecord, events: AsyncIterator[ChoiceEvent]
    ) -> AsyncGenerator[str, None]:
        started: set[int] = set()
        async with record.tracking(), contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                if isinstance(event.payload, PromptScores):
                    continue
                if event.index not in started:
                    started.add(event.index)
                    yield self._chunk(body, record, event.index, Delta(role="assistant", content=""))
                piece = event.payload
                if piece.text or piece.tokens:
                    logprobs = self._logprobs(body, piece.tokens)
                    yield self._chunk(body, record, event.index, Delta(content=piece.text), logprobs)
                if piece.finish_reason is not None:
                    record.completion_tokens += event.generated
                    record.cached_tokens += event.cached_tokens
                    record.finish_reason = piece.finish_reason
                    yield self._chunk(body, record, event.index, Delta(), finish_reason=piece.finish_reason)
            if body.include_usage():
                usage = Usage.of(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
                last = ChatCompletionChunk(id=record.id, model=self.config.model_name, choices=[], usage=usage)
                yield last.model_dump_json()

    def _chunk(
        self,
        body: ChatCompletionRequest,
        record: RequestRecord,
        index: int,
        delta: Delta,
        logprobs: ChoiceLogprobs | None = None,
        finish_reason: FinishReason | None = None,
    ) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(id=record.id, model=self.config.model_name, choices=[choice])
        # OpenAI sends "usage": null on every chunk only when the client asked for the usage chunk.
        return chunk.model_dump_json(exclude=None if body.include_usage() else {"usage"})

    def _logprobs(self, body: ChatCompletionRequest, tokens: Sequence[EmittedToken]) -> ChoiceLogprobs | None:
        if not body.logprobs:
            return None
        return ChoiceLogprobs(content=[self._token_logprob(emitted) for emitted in tokens])

    def _token_logprob(self, emitted: EmittedToken) -> TokenLogprob:
        token = emitted.token
        top = [self._top(token_id, logprob) for token_id, logprob in token.top]
        entry = self._top(token.token_id, token.logprob if token.logprob is not None else 0.0)
        return TokenLogprob(token=entry.token, logprob=entry.logprob, bytes=entry.bytes, top_logprobs=top)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        raw = self.engine.codec.token_bytes(token_id)
        return TopLogprob(token=token_string(raw), logprob=logprob, bytes=list(raw))


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: a role they know and plain-text content."""
    role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for system
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"Content parts of type {part.type!r} are not supported; only text is.",
                    "unsupported_value",
                    "messages",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    result: dict[str, Any] = {"role": role, "content": content or ""}
    if message.name:
        result["name"] = message.name
    return result
