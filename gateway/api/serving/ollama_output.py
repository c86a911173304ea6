"""What Ollama's generation endpoints answer: the NDJSON lines of a stream, the final object's timings, tool calls.

Timings are measured, in nanoseconds, on this request (``Clock``):

    arrived ──load── engine started ──prompt eval── first token ──eval── last token ── total (to the answer's end)

``load_duration`` is what came before the swarm was asked: the chat template, tokenizing, admission (the model itself
is always loaded: the nodes hold it). ``prompt_eval_duration`` is the prefill through the chain up to the first
token; ``eval_duration`` the rest of the generation.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sse_starlette import ServerSentEvent

from gateway.api.protocol.ollama import Timings, now_iso
from gateway.api.serving.choices import ChoiceEvent
from gateway.api.sse import DONE
from gateway.text.assembler import Piece
from gateway.text.tool_parsers import ToolCall


@dataclass
class Clock:
    arrived: int = field(default_factory=time.perf_counter_ns)
    started: int = 0
    first: int = 0
    last: int = 0

    def start(self) -> None:
        self.started = time.perf_counter_ns()

    def saw(self, event: ChoiceEvent) -> None:
        """Note when tokens came (the first, the latest)."""
        if isinstance(event.payload, Piece) and (event.payload.tokens or event.payload.finish_reason):
            now = time.perf_counter_ns()
            self.first = self.first or now
            self.last = now

    def timings(self, prompt_eval_count: int, eval_count: int) -> Timings:
        started = self.started or self.arrived
        first = self.first or started
        return Timings(
            total_duration=time.perf_counter_ns() - self.arrived,
            load_duration=started - self.arrived,
            prompt_eval_count=prompt_eval_count,
            prompt_eval_duration=first - started,
            eval_count=eval_count,
            eval_duration=max(0, (self.last or first) - first),
        )


@dataclass(frozen=True)
class NdjsonStream:
    """A streamed answer: one JSON object a line, the last with ``done: true`` (or ``{"error": ...}``)."""

    id: str
    lines: AsyncIterator[bytes]


def tool_calls_out(calls: list[ToolCall], first_index: int = 0) -> list[dict[str, Any]]:
    """Ollama's tool calls: arguments as an object (text that is no JSON object is kept under ``arguments``)."""
    out = []
    for index, call in enumerate(calls, first_index):
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            arguments = {"arguments": call.arguments}
        if not isinstance(arguments, dict):
            arguments = {"arguments": arguments}
        out.append({"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}})
    return out


def chat_line(
    model: str, content: str, thinking: str = "", calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return {"model": model, "created_at": now_iso(), "message": message, "done": False}


def generate_line(model: str, response: str, thinking: str = "") -> dict[str, Any]:
    line: dict[str, Any] = {"model": model, "created_at": now_iso(), "response": response, "done": False}
    if thinking:
        line["thinking"] = thinking
    return line


def finished(line: dict[str, Any], done_reason: str, timings: Timings) -> dict[str, Any]:
    return {**line, "done": True, "done_reason": done_reason, **timings.model_dump()}


async def ndjson_lines(events: AsyncIterator[ServerSentEvent | bytes]) -> AsyncIterator[bytes]:
    """A session's event log (what /v1 streams as SSE) as NDJSON: keep-alives dropped (an empty line is no JSON to
    Ollama's clients), ``[DONE]`` ends it, an error event becomes Ollama's ``{"error": "..."}`` line."""
    async for event in events:
        if isinstance(event, bytes):
            continue
        data = str(event.data)
        if data == DONE:
            return
        parsed = json.loads(data)
        if isinstance(parsed.get("error"), dict):
            yield json.dumps({"error": parsed["error"].get("message", "error")}).encode() + b"\n"
            continue
        yield data.encode() + b"\n"
