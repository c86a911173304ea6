"""A message assembled block by block, with the stream events Anthropic sends for each step.

    started()        message_start (empty content, input tokens), ping
    thinking(delta)  [content_block_stop of the open block, content_block_start thinking]  thinking_delta
    text(delta)      [..., content_block_start text]  text_delta
    tool_use()       [..., content_block_start tool_use (input {})]
    arguments(delta) input_json_delta (the call's JSON as the model writes it)
    finish()         content_block_stop, message_delta (stop_reason, stop_sequence, usage), message_stop

Text that is only whitespace is held until more comes: before a tool call it is dropped (the chat path drops such
content beside a call too), anywhere else it is written. The non-streamed path builds its message with the same
writer and drops the events, so both paths give the same message.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.api.protocol.messages import MessageResponse, MessageUsage, StopReason

Event = dict[str, Any]


class MessageWriter:
    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": MessageUsage(input_tokens=input_tokens, output_tokens=0).model_dump(),
        }
        self._open: dict[str, Any] | None = None  # the block being written (its content_block_stop not sent yet)
        self._arguments = ""  # the open tool_use block's input as JSON text so far
        self._held = ""  # whitespace not yet written: it opens no text block by itself

    @property
    def content(self) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = self.message["content"]
        return blocks

    def started(self) -> list[Event]:
        return [{"type": "message_start", "message": self.message | {"content": []}}, {"type": "ping"}]

    def thinking(self, delta: str) -> list[Event]:
        events = [] if self._is_open("thinking") else self._start({"type": "thinking", "thinking": "", "signature": ""})
        assert self._open is not None  # opened just above
        self._open["thinking"] += delta
        return [*events, self._delta({"type": "thinking_delta", "thinking": delta})]

    def text(self, delta: str) -> list[Event]:
        if self._is_open("text"):
            return [self._append(delta)]
        if not (self._held + delta).strip():
            self._held += delta
            return []
        delta, self._held = self._held + delta, ""
        return [*self._start({"type": "text", "text": ""}), self._append(delta)]

    def tool_use(self, call_id: str, name: str) -> list[Event]:
        self._held = ""
        self._arguments = ""
        return self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def arguments(self, delta: str) -> list[Event]:
        if not self._is_open("tool_use"):
            raise ValueError("tool call arguments without an open tool_use block")
        self._arguments += delta
        return [self._delta({"type": "input_json_delta", "partial_json": delta})]

    def finish(self, stop_reason: StopReason, stop_sequence: str | None, usage: MessageUsage) -> list[Event]:
        events: list[Event] = []
        if self._held:  # blank text that no tool call followed: it is the answer's (as the chat path keeps it)
            events += [*self._start({"type": "text", "text": ""}), self._append(self._held)]
            self._held = ""
        events += self._close()
        self.message |= {"stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage.model_dump()}
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return [
            *events,
            {"type": "message_delta", "delta": delta, "usage": usage.model_dump()},
            {"type": "message_stop"},
        ]

    def response(self) -> MessageResponse:
        return MessageResponse.model_validate(self.message)

    # -- blocks --------------------------------------------------------------------------------------------------

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.content.append(block)
        self._open = block
        return [*events, {"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}]

    def _append(self, delta: str) -> Event:
        assert self._open is not None  # the callers opened a text block
        self._open["text"] += delta
        return self._delta({"type": "text_delta", "text": delta})

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self) -> list[Event]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _object(self._arguments)
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]  # the open block is the last


def _object(arguments: str) -> dict[str, Any]:
    """A call's arguments as its input; the tool-call parser only closes calls whose JSON parsed."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
