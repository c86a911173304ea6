"""/v1/responses over the chat serving path: the request is translated to a chat request (so tools and structured
outputs behave as on /v1/chat/completions), run as a session with the response's id, and its output written as
OpenAI's output items and stream events.

A stored response (``store``, the default) is kept in Redis with the conversation it ended: ``previous_response_id``
prepends that conversation, and the chat path's kept conversations (``reuse_scope``) let the nodes keep its cache,
so a follow-up prefills only its new tokens. Cancel goes through the sessions' cancel channel (any replica).
``background`` runs a streamed session that no connection holds (resumed from the session's event log); a
``conversation``'s items are the context and receive the turn (``responses_conversation``); WebSocket mode passes
the socket's own ``Kept`` responses (``responses_socket``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

from gateway.api.auth import Caller
from gateway.api.errors import InvalidRequest, NotFound, SessionEnded, as_api_error
from gateway.api.protocol.chat import TokenLogprob
from gateway.api.protocol.common import IGNORED_FIELDS, reject_unsupported
from gateway.api.protocol.responses import (
    ConversationRef,
    DeletedResponse,
    FunctionCall,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    response_id,
)
from gateway.api.request_log import RequestRecord
from gateway.api.serving.chat import ChatServing
from gateway.api.serving.choices import ChoiceEvent, ChoiceSpec
from gateway.api.serving.common import ChoiceResult, RequestContext, Stream
from gateway.api.serving.conversations import ConversationServing
from gateway.api.serving.parsed_choices import parsed_pieces
from gateway.api.serving.responses_conversation import context_of, conversation_id, record_turn
from gateway.api.serving.responses_events import Event, ResponseWriter
from gateway.api.serving.responses_logprobs import MessageLogprobs
from gateway.api.serving.responses_translate import (
    Message,
    Translated,
    assistant_message,
    chat_request,
    check_supported,
    namespaced,
    wants_logprobs,
)
from gateway.generation import SamplingParams
from gateway.state.responses_store import Kept, ResponseStore, StoredResponse
from gateway.text.assembler import FinishReason
from gateway.text.chat_output import ChatOutputParser, OutputDelta
from gateway.text.reasoning import starts_inside

# Responses fields besides the chat path's ignored ones that cannot change the answer.
IGNORED_RESPONSES_FIELDS = frozenset(
    {
        "stream_options",
        "prompt_cache_retention",
        "client_metadata",  # Codex's client hints (installation, session ids): never read by the model
    }
)


@dataclass
class _Turn:
    """One response being made: what it continues, what it sends, and where it is written."""

    body: ResponsesRequest
    caller: Caller
    translated: Translated
    history: list[Message]
    writer: ResponseWriter
    record: RequestRecord
    parser: ChatOutputParser  # the chat path's: reasoning tags and tool calls out of the text
    logprobs: MessageLogprobs | None  # when the request included the message text's logprobs
    local: Kept | None = None  # a WebSocket's own responses (store: false ones are kept only there)
    conversation: str | None = None  # the conversation it belongs to (its input and output go there at the end)
    recorded: bool = False  # whether they went there already

    @property
    def response(self) -> ResponseObject:
        return self.writer.response


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore, conversations: ConversationServing) -> None:
        self.chat = chat
        self.store = store
        self.conversations = conversations
        self._detached: set[asyncio.Task[None]] = set()  # background responses' readers (they keep them running)

    async def create(
        self, body: ResponsesRequest, context: RequestContext, local: Kept | None = None
    ) -> ResponseObject | Stream:
        """``local``: the responses a WebSocket keeps for its own life (``store: false`` ones go there, not to Redis);
        ``previous_response_id`` looks there first."""
        adapter = await self.chat.resolve_model(body.model)
        reject_unsupported(body, IGNORED_FIELDS | IGNORED_RESPONSES_FIELDS)
        turn, specs = await self._plan(body, context.caller, local)
        specs = self.chat.with_adapter(specs, adapter)
        await self._save(turn)
        if body.background:
            return await self._detach(turn, specs, context)
        if body.stream:
            return await self.chat.run_streamed(turn.record, specs, context, lambda e: self._events(turn, e))
        try:
            results = await self.chat.run_collected(turn.record, specs, context)
        except BaseException as exc:
            await asyncio.shield(self._end_badly(turn, exc))
            raise
        write_result(turn, results[0])
        turn.writer.finish(results[0].finish_reason, self._usage(turn.record))
        await self._save(turn)
        return turn.response

    async def _detach(self, turn: _Turn, specs: list[ChoiceSpec], context: RequestContext) -> ResponseObject | Stream:
        """A background response: it runs as a streamed session that nobody's connection holds (a reader task here
        keeps it from being stopped as abandoned); its events stay in the session's log, its end in the store."""
        detached = RequestContext(context.caller, never_leaves)
        started = turn.response.model_copy(deep=True)  # as it starts: the run below writes on into the original
        stream = await self.chat.run_streamed(turn.record, specs, detached, lambda e: self._events(turn, e))
        reader = asyncio.create_task(_drain(stream.events))
        self._detached.add(reader)
        reader.add_done_callback(self._detached.discard)
        if turn.body.stream:  # this connection reads the same log; leaving it does not stop the response
            return Stream(stream.id, self.chat.sessions.read(stream.id, 0))
        return started

    async def resume(self, response_id: str, caller: Caller, starting_after: int | None) -> Stream:
        """A background response's events after sequence number ``starting_after`` (all without it), then its live
        tail, from any replica (event number n in the session's log is sequence number n - 1)."""
        stored = await self._visible(response_id, caller)
        if not stored.response.get("background"):
            raise InvalidRequest("Only a background response can be streamed again.", "invalid_value", "stream")
        after = 0 if starting_after is None else starting_after + 1
        return Stream(response_id, self.chat.sessions.read(response_id, after))

    async def retrieve(self, response_id: str, caller: Caller) -> ResponseObject:
        return ResponseObject.model_validate((await self._visible(response_id, caller)).response)

    async def cancel(self, response_id: str, caller: Caller) -> ResponseObject:
        """Stop a response that is still being made (wherever it runs); the response as it ended."""
        stored = await self._visible(response_id, caller)
        if stored.response.get("status") not in ("in_progress", "queued"):
            raise InvalidRequest("Only a response that is still in progress can be cancelled.", "invalid_value", None)
        with contextlib.suppress(NotFound):  # its session record expired: nothing runs any more
            await self.chat.sessions.cancel(response_id, caller)
        stored = await self._visible(response_id, caller)
        response = ResponseObject.model_validate(stored.response)
        if response.status in ("in_progress", "queued"):  # the run that owns it had not written its end yet
            response.status = "cancelled"
            await self.store.save(response_id, stored.model_copy(update={"response": response.model_dump()}))
        return response

    async def delete(self, response_id: str, caller: Caller) -> DeletedResponse:
        await self._visible(response_id, caller)
        await self.store.delete(response_id)
        return DeletedResponse(id=response_id)

    # -- planning ------------------------------------------------------------------------------------------------

    async def _plan(self, body: ResponsesRequest, caller: Caller, local: Kept | None) -> tuple[_Turn, list[ChoiceSpec]]:
        """The chat path's own steps (tools and format as a grammar, the template, the budget) on the translation."""
        history: list[Message] = []
        conversation = conversation_id(body)
        if body.previous_response_id is not None:
            history = (await self.previous(body.previous_response_id, caller, local)).messages
        elif conversation is not None:
            history = await context_of(self.conversations, conversation, caller)
        translated = chat_request(body, history)
        chat, request = self.chat, translated.chat
        with _renamed_params():
            chat._check_options(request)
            plan = chat.plan(request)
        if plan.reasoning:  # effort would change what a thinking model does: refused unless "none" (the default)
            check_supported(body, reasons=True)
        prompt = await chat.render(request.messages, plan.tools.functions, request.chat_template_kwargs)
        plan = dataclasses.replace(plan, reasoning_inside=plan.reasoning and starts_inside(prompt))
        prompt_ids = await chat.encode_prompt(prompt)
        budget = chat.completion_budget(len(prompt_ids), request.max_completion_tokens, "input")
        specs = chat._specs(request, prompt_ids, budget, caller.scope, plan.grammar)
        response = self._response(body, specs[0].request.sampling, budget)
        record = RequestRecord(response.id, "responses", 1, len(prompt_ids))
        if conversation is not None:
            response.conversation = ConversationRef(id=conversation)
        writer = ResponseWriter(response, namespaced(body.tools or []))
        logprobs = MessageLogprobs(chat.token_logprobs) if wants_logprobs(body) else None
        turn = _Turn(body, caller, translated, history, writer, record, plan.parser(), logprobs, local, conversation)
        return turn, specs

    @staticmethod
    def _response(body: ResponsesRequest, sampling: SamplingParams, budget: int) -> ResponseObject:
        """The response object as it starts: the request's settings as they are applied (the model's sampling
        defaults where the request left them out, the gateway's token cap where it set none)."""
        return ResponseObject(
            id=response_id(),
            model=body.model,  # the base model or the adapter asked for
            instructions=body.instructions,
            max_output_tokens=budget,
            previous_response_id=body.previous_response_id,
            store=body.store is not False,
            temperature=sampling.temperature,
            top_p=0.0 if sampling.top_k == 1 and body.top_p == 0 else sampling.top_p,
            top_logprobs=body.top_logprobs or 0,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            text=(body.text or TextConfig()).echoed(),
            tool_choice=_shown(body.tool_choice) or "auto",
            tools=[tool.echoed() for tool in body.tools or []],
            parallel_tool_calls=body.parallel_tool_calls is not False,
            reasoning=body.reasoning.model_dump(exclude={"generate_summary"})
            if body.reasoning
            else {"effort": None, "summary": None},
            max_tool_calls=body.max_tool_calls,
            user=body.user,
            safety_identifier=body.safety_identifier,
            prompt_cache_key=body.prompt_cache_key,
            service_tier="default",  # one tier here, whatever the request asked for
            background=bool(body.background),
            metadata=body.metadata or {},
        )

    # -- streaming -----------------------------------------------------------------------------------------------

    async def _events(self, turn: _Turn, events: AsyncIterator[ChoiceEvent]) -> AsyncGenerator[str, None]:
        writer, record = turn.writer, turn.record
        finish: FinishReason = "length"
        async with record.tracking(), contextlib.aclosing(events):  # type: ignore[type-var]
            try:
                for event in writer.started():
                    yield _data(event)
                async for piece in parsed_pieces(events, turn.parser, record):
                    logprobs = turn.logprobs.of(piece.text, piece.tokens, piece.delta) if turn.logprobs else []
                    for event in write(writer, piece.delta, logprobs):
                        yield _data(event)
                    finish = piece.finish_reason or finish
                final = writer.finish(finish, self._usage(record))
                await self._save(turn)
            except Exception as exc:
                error = as_api_error(exc)
                final = writer.failed(error.code, error.message)
                await asyncio.shield(self._save(turn))
                for event in final:
                    yield _data(event)
                raise
            except BaseException:  # cancelled, or nobody reads any more
                writer.ended("cancelled")
                await asyncio.shield(self._save(turn))
                raise
            for event in final:
                yield _data(event)

    # -- storage -------------------------------------------------------------------------------------------------

    async def _end_badly(self, turn: _Turn, exc: BaseException) -> None:
        if isinstance(exc, SessionEnded | asyncio.CancelledError) or not isinstance(exc, Exception):
            turn.writer.ended("cancelled")
        else:
            error = as_api_error(exc)
            turn.writer.failed(error.code, error.message)
        await self._save(turn)

    async def _save(self, turn: _Turn) -> None:
        ended = turn.response.status in ("completed", "incomplete")
        if ended and turn.conversation is not None and not turn.recorded:
            turn.recorded = True
            await record_turn(self.conversations, turn.conversation, turn.body, turn.response)
        if not turn.response.store and turn.local is None:
            return
        messages = turn.history + turn.translated.turn
        if turn.response.status in ("completed", "incomplete"):
            calls = [item for item in turn.response.output if isinstance(item, FunctionCall)]
            messages = [*messages, assistant_message(turn.response.output_text, calls)]
        stored = StoredResponse(
            key_id=turn.caller.key_id, response=turn.response.model_dump(mode="json"), messages=messages
        )
        if turn.local is not None:
            turn.local.keep(turn.response.id, stored)
        if turn.response.store:
            await self.store.save(turn.response.id, stored)

    async def previous(self, response_id: str, caller: Caller, local: Kept | None = None) -> StoredResponse:
        """The response ``previous_response_id`` names: this socket's own, else a stored one of the caller's."""
        kept = local.get(response_id) if local is not None else None
        if kept is not None:
            return kept
        stored = await self.store.get(response_id)
        if stored is None or not (caller.admin or stored.key_id == caller.key_id):
            raise InvalidRequest(
                f"Previous response with id {response_id!r} not found.",
                "previous_response_not_found",
                "previous_response_id",
            )
        return stored

    async def _visible(self, response_id: str, caller: Caller, param: str = "response_id") -> StoredResponse:
        stored = await self.store.get(response_id)
        if stored is None or not (caller.admin or stored.key_id == caller.key_id):
            raise NotFound(f"Response with id {response_id!r} not found.", "response_not_found", param)
        return stored

    @staticmethod
    def _usage(record: RequestRecord) -> ResponseUsage:
        return ResponseUsage.of(record.prompt_tokens, record.completion_tokens, record.cached_tokens)


async def never_leaves() -> NoReturn:
    """The stop signal of a background response's "client": there is none to leave (a cancel still stops it)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _drain(events: AsyncIterator[object]) -> None:
    async for _ in events:
        pass


def write(writer: ResponseWriter, out: OutputDelta, logprobs: Sequence[TokenLogprob] = ()) -> list[Event]:
    """What the chat output parser found, as output items: reasoning, message text (``logprobs``: its tokens'),
    then function calls."""
    events = writer.reasoning(out.reasoning) if out.reasoning else []
    if out.content:
        events += writer.text(out.content, logprobs)
    for call in out.calls:
        if call.id is not None:  # a call's first delta: its id and name
            events += writer.function_call(call.name or "", call.id)
        if call.arguments:
            events += writer.arguments(call.arguments)
    return events


def write_result(turn: _Turn, result: ChoiceResult) -> None:
    """A non-streamed choice into the response. With logprobs, token by token as a stream would give it, so that
    each token's logprob goes with the text it wrote (``MessageLogprobs``)."""
    tokens = result.tokens
    if turn.logprobs is None or not tokens:
        write(turn.writer, turn.parser.feed_piece(result.text, last=True))
        return
    ends = [emitted.offset for emitted in tokens[1:]] + [len(result.text)]
    for i, (emitted, end) in enumerate(zip(tokens, ends, strict=True)):
        text = result.text[emitted.offset : end]
        out = turn.parser.feed_piece(text, last=i == len(tokens) - 1)
        write(turn.writer, out, turn.logprobs.of(text, (emitted,), out))


@contextlib.contextmanager
def _renamed_params() -> Iterator[None]:
    """The chat path's errors name chat fields; a Responses client knows them by their Responses names."""
    try:
        yield
    except InvalidRequest as exc:
        exc.param = {"response_format": "text.format", "messages": "input"}.get(exc.param or "", exc.param)
        raise


def _data(event: Event) -> str:
    return json.dumps(event, separators=(",", ":"))


def _shown(choice: object) -> object:
    return choice.model_dump(exclude_none=True) if hasattr(choice, "model_dump") else choice
