"""/v1/chat/completions: messages rendered with the model's own chat template, n choices, OpenAI's chunk shape.

A stream sends, per choice, a first delta with the role, deltas of reasoning, content (with their logprobs) and
tool calls, and a last empty delta carrying ``finish_reason``; then the usage chunk when asked. The output of each
choice goes through a ``ChatOutputParser`` (reasoning tags, tool calls) both ways, so a stream's deltas add up to
the non-streamed message. ``response_format`` and forced tool calls become a grammar the engine enforces.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.api.errors import InvalidRequest
from gateway.api.protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatFinishReason,
    ChatMessage,
    ChoiceLogprobs,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCallOut,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
)
from gateway.api.protocol.common import Usage, reject_unsupported
from gateway.api.request_log import RequestRecord
from gateway.api.serving.chat_prompt import template_has_tools, template_kwargs, template_messages, template_tools
from gateway.api.serving.choices import ChoiceEvent, ChoiceSpec
from gateway.api.serving.common import ChoiceResult, RequestContext, ServingBase, Stream, new_id, token_string
from gateway.api.serving.structured import ToolPlan, output_grammar, plan_tools, schema_grammar
from gateway.generation import GenerationRequest, Grammar, PromptScores
from gateway.text.assembler import EmittedToken
from gateway.text.chat_output import ChatOutputParser, OutputDelta
from gateway.text.reasoning import ReasoningParserName, reasoning_enabled, starts_inside
from gateway.text.tool_parsers import FORMATS, FunctionSpec, ToolCallDelta, ToolFormat, choose_format


@dataclass(frozen=True)
class ChatPlan:
    """What a request's tools, response format and template make of its generation and its output."""

    tools: ToolPlan
    tool_format: ToolFormat | None  # None: no tools offered, no calls parsed
    grammar: Grammar | None
    reasoning: bool  # split <think>...</think> off the content
    reasoning_inside: bool = False  # the prompt already opened <think>

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser.build(self.reasoning, self.reasoning_inside, self.tool_format)


class ChatServing(ServingBase):
    async def create(self, body: ChatCompletionRequest, context: RequestContext) -> ChatCompletionResponse | Stream:
        adapter = await self.resolve_model(body.model)
        reject_unsupported(body)
        self._check_options(body)
        plan = self.plan(body)
        prompt = await self.render(body.messages, plan.tools.functions, body.chat_template_kwargs)
        plan = dataclasses.replace(plan, reasoning_inside=plan.reasoning and starts_inside(prompt))
        prompt_ids = await self.encode_prompt(prompt)
        budget = self.completion_budget(len(prompt_ids), body.max_completion_tokens or body.max_tokens, "messages")
        specs = self.with_adapter(self._specs(body, prompt_ids, budget, context.caller.scope, plan.grammar), adapter)
        record = RequestRecord(new_id("chatcmpl"), "chat", len(specs), len(prompt_ids))
        if body.stream:
            return await self.run_streamed(
                record, specs, context, lambda events: self._chunks(body, plan, record, events)
            )
        results = await self.run_collected(record, specs, context)
        choices = [self._choice(body, plan, result) for result in results]
        usage = Usage.of(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
        return ChatCompletionResponse(
            id=record.id, created=record.created, model=body.model, choices=choices, usage=usage
        )

    def plan(self, body: ChatCompletionRequest) -> ChatPlan:
        template = self.engine.codec.chat_template()
        functions = [
            FunctionSpec(t.function.name, t.function.parameters or {"type": "object"}, t.function.description)
            for t in body.tools or []
        ]
        choice = body.tool_choice
        tools = plan_tools(
            functions,
            choice if isinstance(choice, str) or choice is None else choice.function.name,
            body.parallel_tool_calls is not False,
        )
        fmt = choose_format(template, _configured(self.config.tool_call_parser)) if tools.active else None
        response_format = body.response_format
        schema = None
        if response_format is not None and response_format.json_schema is not None:
            schema = response_format.json_schema.schema_
        if (
            response_format is not None
            and response_format.type == "json_schema"
            and response_format.json_schema is None
        ):
            raise InvalidRequest(
                "response_format json_schema needs its 'json_schema'.", "invalid_value", "response_format"
            )
        format_grammar = schema_grammar(response_format.type if response_format else "text", schema)
        grammar = output_grammar(format_grammar, tools, fmt or FORMATS["hermes"])
        # Under a grammar the output is what the grammar says from its first token: no reasoning to split off.
        reasoning = grammar is None and reasoning_enabled(_reasoning_name(self.config.reasoning_parser), template)
        return ChatPlan(tools, fmt, grammar, reasoning)

    async def render(
        self,
        messages: Sequence[ChatMessage],
        functions: Sequence[FunctionSpec] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the prompt text, with the model's chat template."""
        codec = self.engine.codec
        native = template_has_tools(codec.chat_template())
        rendered = template_messages(messages, functions, native)
        tools = template_tools(functions) if functions and native else None
        return await asyncio.to_thread(codec.render_chat, rendered, tools, template_kwargs(kwargs))

    async def encode_prompt(self, prompt: str) -> list[int]:
        # The template already wrote the special tokens (BOS, role markers): encode it as is.
        ids = await self.encode(prompt, add_special_tokens=False)
        self.check_token_ids(ids, "messages")
        return ids

    async def prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        return await self.encode_prompt(await self.render(messages))

    def _check_options(self, body: ChatCompletionRequest) -> None:
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true.", "invalid_value", "top_logprobs")

    def _specs(
        self,
        body: ChatCompletionRequest,
        prompt_ids: list[int],
        budget: int,
        reuse_scope: str | None,
        grammar: Grammar | None,
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
                grammar=grammar,
            )
            specs.append(ChoiceSpec(i, request, tuple(body.stop_list())))
        return specs

    def _choice(self, body: ChatCompletionRequest, plan: ChatPlan, result: ChoiceResult) -> ChatChoice:
        parser = plan.parser()
        first, last = parser.feed(result.text), parser.finish()
        calls = [
            ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
            for call in parser.tool_calls
        ]
        content = first.content + last.content
        message = AssistantMessage(
            content=None if calls and not content.strip() else content,
            tool_calls=calls or None,
            reasoning_content=(first.reasoning + last.reasoning) or None if plan.reasoning else None,
        )
        finish: ChatFinishReason = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
        return ChatChoice(
            index=result.index, message=message, logprobs=self._logprobs(body, result.tokens), finish_reason=finish
        )

    async def _chunks(
        self, body: ChatCompletionRequest, plan: ChatPlan, record: RequestRecord, events: AsyncIterator[ChoiceEvent]
    ) -> AsyncGenerator[str, None]:
        parsers: dict[int, ChatOutputParser] = {}
        called: set[int] = set()  # choices that sent a tool call
        async with record.tracking(), contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                if isinstance(event.payload, PromptScores):
                    continue
                if event.index not in parsers:
                    parsers[event.index] = plan.parser()
                    yield self._chunk(body, record, event.index, Delta(role="assistant", content=""))
                piece = event.payload
                parser = parsers[event.index]
                out = parser.feed_piece(piece.text, last=piece.finish_reason is not None)
                if out.calls:
                    called.add(event.index)
                if out or (piece.tokens and body.logprobs):  # text held back (a tool call's markup): nothing yet
                    logprobs = self._logprobs(body, piece.tokens)
                    yield self._chunk(body, record, event.index, _delta(out), logprobs)
                if piece.finish_reason is not None:
                    record.completion_tokens += event.generated
                    record.cached_tokens += event.cached_tokens
                    record.finish_reason = piece.finish_reason
                    finish: ChatFinishReason = piece.finish_reason
                    if event.index in called and finish == "stop":
                        finish = "tool_calls"
                    yield self._chunk(body, record, event.index, Delta(), finish_reason=finish)
            if body.include_usage():
                usage = Usage.of(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
                last = ChatCompletionChunk(
                    id=record.id, created=record.created, model=body.model, choices=[], usage=usage
                )
                yield last.model_dump_json()

    def _chunk(
        self,
        body: ChatCompletionRequest,
        record: RequestRecord,
        index: int,
        delta: Delta,
        logprobs: ChoiceLogprobs | None = None,
        finish_reason: ChatFinishReason | None = None,
    ) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(id=record.id, created=record.created, model=body.model, choices=[choice])
        # OpenAI sends "usage": null on every chunk only when the client asked for the usage chunk.
        return chunk.model_dump_json(exclude=None if body.include_usage() else {"usage"})

    def _logprobs(self, body: ChatCompletionRequest, tokens: Sequence[EmittedToken]) -> ChoiceLogprobs | None:
        if not body.logprobs:
            return None
        return ChoiceLogprobs(content=self.token_logprobs(tokens))

    def token_logprobs(self, tokens: Sequence[EmittedToken]) -> list[TokenLogprob]:
        """OpenAI's logprob entries of ``tokens`` (with their alternatives, as many as the request asked for)."""
        return [self._token_logprob(emitted) for emitted in tokens]

    def _token_logprob(self, emitted: EmittedToken) -> TokenLogprob:
        token = emitted.token
        top = [self._top(token_id, logprob) for token_id, logprob in token.top]
        entry = self._top(token.token_id, token.logprob if token.logprob is not None else 0.0)
        return TokenLogprob(token=entry.token, logprob=entry.logprob, bytes=entry.bytes, top_logprobs=top)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        raw = self.engine.codec.token_bytes(token_id)
        return TopLogprob(token=token_string(raw), logprob=logprob, bytes=list(raw))


def _configured(name: str) -> str | None:
    return None if name == "auto" else name


def _reasoning_name(name: str) -> ReasoningParserName:
    if name not in ("auto", "none", "qwen3", "deepseek_r1"):
        raise ValueError(f"unknown reasoning parser {name!r}")
    return name  # type: ignore[return-value]  # checked just above


def _delta(out: OutputDelta) -> Delta:
    """One chunk's delta: a call's pieces in this chunk merged into one entry (id and name on its first)."""
    merged: dict[int, DeltaToolCall] = {}
    for call in out.calls:
        merged[call.index] = _merge(merged.get(call.index), call)
    return Delta(
        content=out.content or None,
        reasoning_content=out.reasoning or None,
        tool_calls=list(merged.values()) or None,
    )


def _merge(entry: DeltaToolCall | None, call: ToolCallDelta) -> DeltaToolCall:
    if entry is None:
        kind = "function" if call.id is not None else None
        return DeltaToolCall(
            index=call.index, id=call.id, type=kind, function=DeltaFunction(name=call.name, arguments=call.arguments)
        )
    arguments = (entry.function.arguments or "") + call.arguments
    return entry.model_copy(update={"function": DeltaFunction(name=entry.function.name, arguments=arguments)})
