"""Ollama's /api/chat and /api/generate over the chat serving path.

A request becomes a chat request (``ollama_translate``), so tools, ``format`` (a grammar), the template, the budget
and the sampling are the chat path's own; it runs as a session (quotas, cancel, the client leaving) and its output
goes through the same parser (reasoning, tool calls). A stream is NDJSON, Ollama's default; the last line carries
``done: true``, ``done_reason`` and the measured timings. Generation without ``raw`` renders the prompt (and
``system``) with the model's chat template, as Ollama does with its own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.api.errors import InvalidRequest, NotFound
from gateway.api.protocol.chat import ChatCompletionRequest
from gateway.api.protocol.ollama import ChatRequest, GenerateRequest, GenerationFields, now_iso
from gateway.api.request_log import RequestRecord
from gateway.api.serving.chat import ChatPlan, ChatServing
from gateway.api.serving.choices import ChoiceEvent, ChoiceSpec
from gateway.api.serving.common import ChoiceResult, RequestContext, new_id
from gateway.api.serving.ollama_output import (
    Clock,
    NdjsonStream,
    chat_line,
    finished,
    generate_line,
    ndjson_lines,
    tool_calls_out,
)
from gateway.api.serving.ollama_translate import (
    chat_request,
    check_fields,
    check_options,
    ollama_not_found,
    untagged,
)
from gateway.api.serving.stop_signals import race
from gateway.generation import PromptScores
from gateway.text.chat_output import ChatOutputParser
from gateway.text.reasoning import starts_inside

Answer = dict[str, Any] | NdjsonStream


@dataclass
class _Run:
    """One request on its way: what shapes its lines, and what it measured."""

    body: GenerationFields
    plan: ChatPlan
    record: RequestRecord
    clock: Clock
    chat: bool  # /api/chat's lines (a message) or /api/generate's (a response)
    prompt_ids: list[int]

    def line(self, parser: ChatOutputParser, text: str, final: bool, emitted: int) -> dict[str, Any]:
        out = parser.feed(text)
        if final:
            last = parser.finish()
            out = dataclasses.replace(out, reasoning=out.reasoning + last.reasoning, content=out.content + last.content)
        if not self.chat:
            return generate_line(self.body.model, out.content, out.reasoning)
        calls = tool_calls_out(parser.tool_calls[emitted:], emitted)
        return chat_line(self.body.model, out.content, out.reasoning, calls)

    def last(self, line: dict[str, Any], finish_reason: str | None, generated: int, cached: int) -> dict[str, Any]:
        done = finished(line, "length" if finish_reason == "length" else "stop", self.timings(generated, cached))
        if not self.chat:
            done["context"] = self.prompt_ids  # the deprecated ``context``: what a follow-up may send back
        return done

    def timings(self, generated: int, cached: int) -> Any:
        return self.clock.timings(len(self.prompt_ids) - cached, generated)


class OllamaServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def resolve(self, name: str) -> tuple[str, str | None]:
        """(our model name, the LoRA adapter it names) for ``name`` with or without ``:latest``; Ollama's 404."""
        base = untagged(name)
        try:
            adapter = await self.chat.resolve_model(base)
        except NotFound:
            raise ollama_not_found(name) from None
        return (self.chat.config.model_name if adapter is None else adapter), adapter

    async def chat_answer(self, body: ChatRequest, context: RequestContext) -> Answer:
        clock = Clock()
        model, adapter = await self.resolve(body.model)
        check_fields(body, ("logprobs", "top_logprobs"))
        check_options(body.options, self.chat.engine.context_length)
        if not body.messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
            return _loaded(chat_line(body.model, ""), body.keep_alive)
        request = chat_request(body, model, _thinking(body))
        plan = self._plan(request, body)
        prompt = await self.chat.render(request.messages, plan.tools.functions, request.chat_template_kwargs)
        plan = dataclasses.replace(plan, reasoning_inside=plan.reasoning and starts_inside(prompt))
        prompt_ids = await self.chat.encode_prompt(prompt)
        run = _Run(
            body, plan, RequestRecord(new_id("ollama"), "ollama_chat", 1, len(prompt_ids)), clock, True, prompt_ids
        )
        return await self._answer(run, request, adapter, context)

    async def generate_answer(self, body: GenerateRequest, context: RequestContext) -> Answer:
        clock = Clock()
        model, adapter = await self.resolve(body.model)
        check_fields(body, ("logprobs", "top_logprobs", "suffix", "template", "images"))
        check_options(body.options, self.chat.engine.context_length)
        if not body.prompt and not body.context:
            return _loaded(generate_line(body.model, ""), body.keep_alive)
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}
        ]
        chat_body = ChatRequest.model_validate({**body.model_dump(exclude={"prompt", "system"}), "messages": messages})
        request = chat_request(chat_body, model, _thinking(body))
        plan = self._plan(request, body)
        if body.raw:  # the prompt as it is, no template (Ollama ignores ``system`` then too)
            ids = await self.chat.encode(body.prompt)
        else:
            ids = await self.chat.encode_prompt(await self.chat.render(request.messages))
        prompt_ids = list(body.context or []) + ids
        self.chat.check_token_ids(prompt_ids, "prompt")
        run = _Run(
            body, plan, RequestRecord(new_id("ollama"), "ollama_generate", 1, len(prompt_ids)), clock, False, prompt_ids
        )
        return await self._answer(run, request, adapter, context)

    def _plan(self, request: ChatCompletionRequest, body: GenerationFields) -> ChatPlan:
        plan = self.chat.plan(request)
        if body.think and not plan.reasoning:
            raise InvalidRequest(f'"{body.model}" does not support thinking', "invalid_value", "think")
        return plan

    async def _answer(
        self, run: _Run, request: ChatCompletionRequest, adapter: str | None, context: RequestContext
    ) -> Answer:
        budget = self.chat.completion_budget(len(run.prompt_ids), request.max_tokens, "messages")
        specs = self.chat._specs(request, run.prompt_ids, budget, context.caller.scope, run.plan.grammar)
        specs = self.chat.with_adapter(specs, adapter)
        run.clock.start()
        if run.body.stream:
            stream = await self.chat.run_streamed(run.record, specs, context, lambda events: self._lines(run, events))
            return NdjsonStream(stream.id, ndjson_lines(stream.events))
        result = await self._collected(run, specs, context)
        line = run.line(run.plan.parser(), result.text, True, 0)
        return run.last(line, result.finish_reason, result.generated, result.cached_tokens)

    async def _lines(self, run: _Run, events: AsyncIterator[ChoiceEvent]) -> AsyncGenerator[str, None]:
        parser, emitted = run.plan.parser(), 0
        async with run.record.tracking():
            async for event in events:
                run.clock.saw(event)
                piece = event.payload
                if isinstance(piece, PromptScores):
                    continue  # never asked for here
                final = piece.finish_reason is not None
                line = run.line(parser, piece.text, final, emitted)
                emitted = len(parser.tool_calls)
                if final:
                    run.record.completion_tokens = event.generated
                    run.record.finish_reason = piece.finish_reason
                    yield _compact(run.last(line, piece.finish_reason, event.generated, event.cached_tokens))
                elif _has_output(line):
                    yield _compact(line)

    async def _collected(self, run: _Run, specs: list[ChoiceSpec], context: RequestContext) -> ChoiceResult:
        live = await self.chat._open_session(run.record, specs, context)

        async def gather() -> ChoiceResult:
            result = ChoiceResult(0)
            async for event in self.chat.events(specs):
                run.clock.saw(event)
                result.add(event)
            return result

        async def tracked() -> ChoiceResult:
            async with run.record.tracking():
                result = await race(gather(), context.client_left, live.cancelled)
                run.record.completion_tokens, run.record.finish_reason = result.generated, result.finish_reason
                return result

        return await live.finish_after(tracked())


def _thinking(body: GenerationFields) -> bool | None:
    """``think`` as the template's enable_thinking: true, false, or a level ("high", ...) that means true."""
    return None if body.think is None else bool(body.think)


def _has_output(line: dict[str, Any]) -> bool:
    message = line.get("message", line)
    return bool(
        message.get("content") or message.get("response") or message.get("thinking") or message.get("tool_calls")
    )


def _loaded(line: dict[str, Any], keep_alive: float | str | None) -> dict[str, Any]:
    unload = keep_alive in (0, "0", "0s", "0m")
    return {**line, "created_at": now_iso(), "done": True, "done_reason": "unload" if unload else "load"}


def _compact(line: dict[str, Any]) -> str:
    return json.dumps(line, separators=(",", ":"))  # as Ollama writes its lines
