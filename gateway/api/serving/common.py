"""What both generation endpoints share: model and parameter checks, prompt limits, and running the choices.

Serving classes depend on ``gateway.generation.Engine`` only; they return either a response model or a
``Stream`` of SSE data strings, and never touch HTTP objects (the router hands them a ``client_left`` stop signal).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from sse_starlette import ServerSentEvent

from gateway.api.auth import Caller
from gateway.api.errors import InvalidRequest, model_not_found
from gateway.api.protocol.common import SamplingFields
from gateway.api.request_log import RequestRecord, failure
from gateway.api.serving.choices import ChoiceEvent, ChoiceSpec, merge, prime, run_choice
from gateway.api.serving.live_sessions import LiveSession, SessionTracker
from gateway.api.serving.stop_signals import Signal, race
from gateway.generation import Engine, PromptScores, SamplingParams
from gateway.text.assembler import EmittedToken, FinishReason, Piece

T = TypeVar("T")


@dataclass(frozen=True)
class ServingConfig:
    model_name: str  # the id clients send and are answered with
    default_max_tokens: int = 0  # chat requests without max_tokens; 0: the rest of the context window
    max_request_bytes: int = 8 * 1024 * 1024  # larger bodies: 413 before parsing (0: no limit)
    tool_call_parser: str = "auto"  # hermes | llama3_json | mistral; auto: from the chat template
    reasoning_parser: str = "auto"  # qwen3 | deepseek_r1 | none; auto: when the chat template knows </think>
    responses_ttl: float = 86400.0  # seconds a stored /v1/responses response is kept after its last change
    # The model's own sampling defaults (generation_config.json: temperature, top_p, top_k, repetition_penalty),
    # used where a request leaves a parameter out.
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestContext:
    """Who sent the request, and how to tell that they left."""

    caller: Caller
    client_left: Signal  # fires with ``ClientDisconnected`` (the router builds it from the ASGI receive channel)


@dataclass(frozen=True)
class Stream:
    """A streamed response: its id (also the X-Session-Id header) and its SSE events (ids are event numbers)."""

    id: str
    events: AsyncIterator[ServerSentEvent | bytes]  # bytes: keep-alive comment lines


@dataclass
class ChoiceResult:
    """One choice's events gathered for a non-streaming response."""

    index: int
    text: str = ""
    tokens: list[EmittedToken] = field(default_factory=list)
    prompt: PromptScores | None = None
    finish_reason: FinishReason = "length"
    stop: str | None = None  # the stop string that ended it, if one did
    generated: int = 0
    logprob_sum: float = 0.0
    cached_tokens: int = 0

    def add(self, event: ChoiceEvent) -> None:
        if isinstance(event.payload, PromptScores):
            self.prompt = event.payload
            return
        self.text += event.payload.text
        self.tokens += event.payload.tokens
        if event.payload.finish_reason is not None:
            self.finish_reason, self.stop = event.payload.finish_reason, event.payload.stop
            self.generated, self.logprob_sum = event.generated, event.logprob_sum
            self.cached_tokens = event.cached_tokens

    @property
    def mean_logprob(self) -> float:
        return self.logprob_sum / max(1, len(self.tokens))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def token_string(raw: bytes) -> str:
    """A token as OpenAI spells it: its text, or ``bytes:\\xNN…`` when it is part of a multi-byte character."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


class ServingBase:
    def __init__(self, engine: Engine, config: ServingConfig, sessions: SessionTracker) -> None:
        self.engine = engine
        self.config = config
        self.sessions = sessions

    @property
    def codec_vocab(self) -> int:
        return self.engine.codec.vocab_size

    def check_model(self, model: str) -> None:
        """The base model only (tokenize / detokenize: the tokenizer is the same for every adapter)."""
        if model != self.config.model_name:
            raise model_not_found(model)

    async def resolve_model(self, model: str) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); ``model_not_found`` for any other name, and for an
        adapter that no live node serves for every block now (it is not in /v1/models either)."""
        if model == self.config.model_name:
            return None
        if model in await self.engine.served_adapters():
            return model
        raise model_not_found(model)

    @staticmethod
    def with_adapter(specs: list[ChoiceSpec], adapter: str | None) -> list[ChoiceSpec]:
        if adapter is None:
            return specs
        return [dataclasses.replace(s, request=dataclasses.replace(s.request, adapter=adapter)) for s in specs]

    def sampling_params(self, body: SamplingFields) -> SamplingParams:
        # What the request leaves out comes from the model's generation_config.json, then OpenAI's defaults.
        defaults = self.config.sampling_defaults
        temperature = defaults.get("temperature", 1.0) if body.temperature is None else body.temperature
        top_p = defaults.get("top_p", 1.0) if body.top_p is None else body.top_p
        top_k = int(defaults.get("top_k", 0)) if body.top_k is None else body.top_k
        repetition = (
            defaults.get("repetition_penalty", 1.0) if body.repetition_penalty is None else body.repetition_penalty
        )
        # top_p 0 keeps only the most likely token: greedy (the probability cut alone would keep nothing).
        if top_p == 0:
            top_k = 1
        return SamplingParams(
            temperature=temperature,
            top_p=top_p or 1.0,
            top_k=max(0, top_k),
            min_p=body.min_p or 0.0,
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=repetition,
            logit_bias=self._logit_bias(body.logit_bias),
        )

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        pairs: list[tuple[int, float]] = []
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < self.codec_vocab:
                message = f"Invalid key in 'logit_bias': {key!r} is not a token id"
                raise InvalidRequest(message, "invalid_value", "logit_bias")
            if not -100 <= value <= 100:
                message = f"Invalid value in 'logit_bias' for {key}: {value} is outside [-100, 100]"
                raise InvalidRequest(message, "invalid_value", "logit_bias")
            pairs.append((int(key), value))
        return tuple(pairs)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise InvalidRequest("The prompt is empty: there is no token to continue from.", "invalid_value", param)
        if any(not 0 <= token < self.codec_vocab for token in ids):
            raise InvalidRequest(f"Token ids in '{param}' must lie in [0, {self.codec_vocab}).", "invalid_value", param)

    def completion_budget(self, prompt_tokens: int, requested: int | None, param: str) -> int:
        """Tokens to generate: ``requested`` (None: the server's default) within the context window."""
        limit = self.engine.context_length
        room = limit - prompt_tokens
        asked = requested
        if requested is None:
            default = self.config.default_max_tokens
            requested = min(default, room) if default > 0 else room
        # A prompt that fills the window exactly is fine with max_tokens 0 (scoring it), not with nothing asked.
        if prompt_tokens + requested > limit or (room <= 0 and asked is None):
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the "
                "completion). Please reduce the prompt or the completion length.",
                "context_length_exceeded",
                param,
            )
        return requested

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Long inputs take a while to tokenize: keep the event loop free.
        return await asyncio.to_thread(self.engine.codec.encode, text, add_special_tokens)

    def events(self, specs: list[ChoiceSpec]) -> AsyncIterator[ChoiceEvent]:
        return merge([run_choice(self.engine, spec) for spec in specs])

    async def collect(self, record: RequestRecord, specs: list[ChoiceSpec], *stops: Signal) -> list[ChoiceResult]:
        async def gather() -> list[ChoiceResult]:
            results = {spec.index: ChoiceResult(spec.index) for spec in specs}
            async for event in self.events(specs):
                results[event.index].add(event)
            return [results[spec.index] for spec in specs]

        async with record.tracking():
            results = await race(gather(), *stops)
            record.completion_tokens = sum(result.generated for result in results)
            record.cached_tokens = sum(result.cached_tokens for result in results)
            record.finish_reason = results[-1].finish_reason if results else None
        return results

    async def run_streamed(
        self,
        record: RequestRecord,
        specs: list[ChoiceSpec],
        context: RequestContext,
        chunks_of: Callable[[AsyncIterator[ChoiceEvent]], AsyncGenerator[str, None]],
    ) -> Stream:
        """Start the choices as a session whose chunks (``chunks_of`` the choices' events) are its SSE events."""
        live = await self._open_session(record, specs, context)
        start = self.start(record, specs, context.client_left, live.cancelled)
        events = await live.finish_after(start, on_success=False)
        return Stream(record.id, live.stream(chunks_of(events)))

    async def run_collected(
        self, record: RequestRecord, specs: list[ChoiceSpec], context: RequestContext
    ) -> list[ChoiceResult]:
        """Run the choices as a session to the end; the client leaving or a cancel stops them."""
        live = await self._open_session(record, specs, context)
        return await live.finish_after(self.collect(record, specs, context.client_left, live.cancelled))

    async def _open_session(
        self, record: RequestRecord, specs: list[ChoiceSpec], context: RequestContext
    ) -> LiveSession:
        # The quota is charged for every token the request may use; what it does not use is given back at the end.
        reserve = record.prompt_tokens + sum(spec.request.max_new_tokens for spec in specs)
        return await self.sessions.open(record, context.caller, reserve)

    async def start(self, record: RequestRecord, specs: list[ChoiceSpec], *stops: Signal) -> AsyncIterator[ChoiceEvent]:
        """The choices' events with the first already there (so a failure to start is an HTTP error)."""
        try:
            return await race(prime(self.events(specs)), *stops)
        except BaseException as exc:
            record.done(failure(exc))
            raise


def last_piece(event: ChoiceEvent) -> Piece | None:
    return event.payload if isinstance(event.payload, Piece) and event.payload.finish_reason else None
