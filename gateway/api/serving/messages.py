"""/v1/messages over the chat serving path: the request is translated to a chat request (so tools, the tool grammar,
the chat template and the reasoning parser behave as on /v1/chat/completions), run as a session whose id is the
message's (``msg_...``: ``/v1/sessions/{id}`` lists, replays and cancels it), and its output written as Anthropic's
content blocks and stream events. ``/v1/messages/count_tokens`` renders the same prompt and counts it.

``max_tokens`` (required) may exceed what the context window has left, as with Anthropic's newer models: the answer
then ends where the window does, with ``stop_reason: model_context_window_exceeded``.

A stream is the session's event log (``LiveSession``) read with Anthropic's SSE framing: each event named by its
``type`` (``event: content_block_delta``), keep-alives as ``ping`` events, an error after the start as an ``error``
event, and no ``[DONE]`` (Anthropic's streams end after ``message_stop``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass

from sse_starlette import ServerSentEvent

from gateway.api.anthropic_errors import stream_error
from gateway.api.errors import InvalidRequest
from gateway.api.protocol.messages import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TokenCount,
    message_id,
)
from gateway.api.request_log import RequestRecord
from gateway.api.serving.chat import ChatPlan, ChatServing
from gateway.api.serving.choices import ChoiceEvent, ChoiceSpec
from gateway.api.serving.common import RequestContext, Stream
from gateway.api.serving.messages_events import Event, MessageWriter
from gateway.api.serving.messages_translate import Translated, chat_request
from gateway.api.serving.parsed_choices import parsed_pieces
from gateway.api.sse import DONE
from gateway.text.assembler import FinishReason
from gateway.text.chat_output import ChatOutputParser, OutputDelta
from gateway.text.reasoning import starts_inside

PING = json.dumps({"type": "ping"})
SEP = "\n"  # lines end with LF, as Anthropic's do (and readers that split on LF expect)


@dataclass
class _Turn:
    """One message being made: its budget (what max_tokens asked, what the window allows) and its writer."""

    asked: int
    budget: int
    writer: MessageWriter
    record: RequestRecord
    parser: ChatOutputParser  # the chat path's: reasoning tags and tool calls out of the text
    called: bool = False  # a tool call was written

    def stop_reason(self, finish: FinishReason, stop: str | None) -> tuple[StopReason, str | None]:
        if finish == "length":
            return ("max_tokens" if self.budget == self.asked else "model_context_window_exceeded"), None
        if self.called:
            return "tool_use", None
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)

    def usage(self) -> MessageUsage:
        record = self.record
        # Anthropic counts the prompt tokens read from a cache apart from those computed (they add up to the prompt).
        return MessageUsage(
            input_tokens=record.prompt_tokens - record.cached_tokens,
            output_tokens=record.completion_tokens,
            cache_read_input_tokens=record.cached_tokens,
        )


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, body: MessagesRequest, context: RequestContext) -> MessageResponse | Stream:
        adapter = await self.chat.resolve_model(body.model)
        translated = chat_request(body)
        plan, prompt_ids = await self._prompt(translated)
        budget = self._budget(len(prompt_ids), body.max_tokens)
        specs = self.chat.with_adapter(self._specs(translated, plan, prompt_ids, budget, context), adapter)
        record = RequestRecord(message_id(), "messages", 1, len(prompt_ids))
        turn = _Turn(
            body.max_tokens, budget, MessageWriter(record.id, body.model, len(prompt_ids)), record, plan.parser()
        )
        if body.stream:
            stream = await self.chat.run_streamed(record, specs, context, lambda events: self._events(turn, events))
            return Stream(stream.id, anthropic_events(stream.events))
        result = (await self.chat.run_collected(record, specs, context))[0]
        write(turn, turn.parser.feed_piece(result.text, last=True))
        turn.writer.finish(*turn.stop_reason(result.finish_reason, result.stop), turn.usage())
        return turn.writer.response()

    async def count_tokens(self, body: CountTokensRequest) -> TokenCount:
        await self.chat.resolve_model(body.model)
        _, prompt_ids = await self._prompt(chat_request(body))
        return TokenCount(input_tokens=len(prompt_ids))

    async def _prompt(self, translated: Translated) -> tuple[ChatPlan, list[int]]:
        """The chat path's plan (tools as a grammar, reasoning) and prompt, continued by the prefill."""
        chat, request = self.chat, translated.chat
        with _renamed_params():
            plan = chat.plan(request)
            prompt = await chat.render(request.messages, plan.tools.functions, request.chat_template_kwargs)
        prompt += translated.prefill
        plan = dataclasses.replace(plan, reasoning_inside=plan.reasoning and starts_inside(prompt))
        return plan, await chat.encode_prompt(prompt)

    def _budget(self, prompt_tokens: int, max_tokens: int) -> int:
        """``max_tokens``, or what the context window leaves when that is less (at least one token)."""
        limit = self.chat.engine.context_length
        if prompt_tokens >= limit:
            raise InvalidRequest(
                f"prompt is too long: {prompt_tokens} tokens, and this model's context window is {limit} tokens "
                "(at least one must be left for the answer).",
                "context_length_exceeded",
                "messages",
            )
        return min(max_tokens, limit - prompt_tokens)

    def _specs(
        self, translated: Translated, plan: ChatPlan, prompt_ids: list[int], budget: int, context: RequestContext
    ) -> list[ChoiceSpec]:
        return self.chat._specs(translated.chat, prompt_ids, budget, context.caller.scope, plan.grammar)

    async def _events(self, turn: _Turn, events: AsyncIterator[ChoiceEvent]) -> AsyncGenerator[str, None]:
        writer, record = turn.writer, turn.record
        async with record.tracking(), contextlib.aclosing(events):  # type: ignore[type-var]
            for event in writer.started():
                yield _data(event)
            async for piece in parsed_pieces(events, turn.parser, record):
                for event in write(turn, piece.delta):
                    yield _data(event)
                if piece.finish_reason is not None:
                    for event in writer.finish(*turn.stop_reason(piece.finish_reason, piece.stop), turn.usage()):
                        yield _data(event)


def write(turn: _Turn, out: OutputDelta) -> list[Event]:
    """What the chat output parser found, as content blocks: thinking, text, then tool calls."""
    writer = turn.writer
    events = writer.thinking(out.reasoning) if out.reasoning else []
    if out.content:
        events += writer.text(out.content)
    for call in out.calls:
        if call.id is not None:  # a call's first delta: its id and name
            turn.called = True
            events += writer.tool_use(_tool_use_id(call.id), call.name or "")
        if call.arguments:
            events += writer.arguments(call.arguments)
    return events


async def anthropic_events(events: AsyncIterator[ServerSentEvent | bytes]) -> AsyncIterator[ServerSentEvent | bytes]:
    """The session's log as Anthropic frames it: named events, pings, its error event, no ``[DONE]``."""
    async for item in events:
        if isinstance(item, bytes):  # an idle stream's keep-alive
            yield ServerSentEvent(data=PING, event="ping", sep=SEP)
            continue
        if item.data == DONE:
            continue
        text = str(item.data)
        data = json.loads(text)
        if "type" not in data:  # the session's own error event (a failure, a cancel): OpenAI's body
            data = stream_error(data)
            text = json.dumps(data)
        yield ServerSentEvent(data=text, event=data["type"], id=item.id, retry=item.retry, sep=SEP)


def _tool_use_id(call_id: str) -> str:
    """Anthropic's ids read ``toolu_...``; the chat path's ``call_...``."""
    return "toolu_" + call_id.removeprefix("call_")


def _data(event: Event) -> str:
    return json.dumps(event, separators=(",", ":"))


@contextlib.contextmanager
def _renamed_params() -> Iterator[None]:
    """The chat path's errors name chat fields; a Messages client knows them by their Messages names."""
    names = {"response_format": "output_config.format"}
    try:
        yield
    except InvalidRequest as exc:
        exc.param = names.get(exc.param or "", exc.param)
        raise
