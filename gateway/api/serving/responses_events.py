"""A response's output assembled piece by piece, with the stream events OpenAI sends for each step.

    started()        response.created, response.in_progress
    reasoning(delta) [response.output_item.added (a reasoning item)]  response.reasoning_text.delta
    text(delta)      [response.output_item.added, response.content_part.added]  response.output_text.delta
                     (with the logprobs of the delta's tokens, when the request included them)
    function_call()  [the open item's .done events]  response.output_item.added (a function_call item)
    arguments(delta) response.function_call_arguments.delta
    finish()         the open item's .done events, then response.completed (or response.incomplete)
    failed()         error, response.failed

Text that is only whitespace is held until more comes: before a function call it is dropped (as the chat path
leaves a message that only calls without content). Every event carries its ``sequence_number``. The non-streamed
path builds its response with the same writer and drops the events, so both paths give the same object.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gateway.api.protocol.chat import TokenLogprob
from gateway.api.protocol.responses import (
    FunctionCall,
    IncompleteDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    Phase,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
)
from gateway.text.assembler import FinishReason

Event = dict[str, Any]


class ResponseWriter:
    def __init__(self, response: ResponseObject, namespaced: dict[str, tuple[str, str]] | None = None) -> None:
        self.response = response
        self.namespaced = namespaced or {}  # "namespace.name" -> (namespace, name): a namespace tool's functions
        self._sequence = 0
        self._open: OutputItem | None = None  # the item being written (its .done events not sent yet)
        self._held = ""  # whitespace not yet written: it opens no message by itself
        self._held_logprobs: list[TokenLogprob] = []  # its tokens'

    def started(self) -> list[Event]:
        return [self._with_response("response.created"), self._with_response("response.in_progress")]

    def reasoning(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self._open, ReasoningItem):
            events += self._close("completed")
            events += self._add(ReasoningItem(content=[ReasoningText(text="")]))
        item = self._open
        assert isinstance(item, ReasoningItem)  # opened just above
        item.content[0].text += delta
        events.append(self._event("response.reasoning_text.delta", **self._where(), delta=delta))
        return events

    def text(self, delta: str, logprobs: Sequence[TokenLogprob] = ()) -> list[Event]:
        if isinstance(self._open, OutputMessage):
            return [self._append(delta, logprobs)]
        if not (self._held + delta).strip():
            self._held += delta
            self._held_logprobs += logprobs
            return []
        delta, self._held = self._held + delta, ""
        logprobs, self._held_logprobs = [*self._held_logprobs, *logprobs], []
        return [*self._open_message(), self._append(delta, logprobs)]

    def function_call(self, name: str, call_id: str | None = None) -> list[Event]:
        self._held, self._held_logprobs = "", []
        events = self._close("completed", phase="commentary")
        namespace, name = self.namespaced.get(name, (None, name))
        call = FunctionCall(name=name, namespace=namespace)
        if call_id is not None:
            call.call_id = call_id
        events += self._add(call)
        return events

    def arguments(self, delta: str) -> list[Event]:
        call = self._open
        if not isinstance(call, FunctionCall):
            raise ValueError("function call arguments without an open function_call item")
        call.arguments += delta
        index = len(self.response.output) - 1
        return [self._event("response.function_call_arguments.delta", item_id=call.id, output_index=index, delta=delta)]

    def finish(self, finish_reason: FinishReason, usage: ResponseUsage) -> list[Event]:
        """The end: ``length`` (the token budget ran out) makes the response ``incomplete``."""
        events: list[Event] = []
        answered = any(isinstance(item, OutputMessage | FunctionCall) for item in self.response.output)
        if not answered:  # an empty (or blank) answer is still a message
            events += self._open_message()
            if self._held:
                events.append(self._append(self._held, self._held_logprobs))
        self._held, self._held_logprobs = "", []
        complete = finish_reason != "length"
        events += self._close("completed" if complete else "incomplete", phase="final_answer")
        self.response.usage = usage
        if complete:
            self.response.status = "completed"
            self.response.completed_at = int(time.time())
            return [*events, self._with_response("response.completed")]
        self.response.status = "incomplete"
        self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return [*events, self._with_response("response.incomplete")]

    def failed(self, code: str, message: str) -> list[Event]:
        self._close("incomplete", events=False)
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        error = self._event("error", code=code, message=message, param=None)
        return [error, self._with_response("response.failed")]

    def ended(self, status: ResponseStatus) -> None:
        """Ended without a final event (cancelled, or the client went away): the object records how."""
        self._close("incomplete", events=False)
        self.response.status = status

    # -- items ---------------------------------------------------------------------------------------------------

    def _open_message(self) -> list[Event]:
        events = self._close("completed")
        message = OutputMessage()
        events += self._add(message)
        message.content.append(OutputText(text=""))
        part = message.content[0].model_dump(mode="json")
        events.append(self._event("response.content_part.added", **self._where(), part=part))
        return events

    def _append(self, delta: str, logprobs: Sequence[TokenLogprob]) -> Event:
        message = self._open
        assert isinstance(message, OutputMessage)  # the callers opened it
        message.content[0].text += delta
        message.content[0].logprobs += logprobs
        shown = [logprob.model_dump(mode="json") for logprob in logprobs]
        return self._event("response.output_text.delta", **self._where(), delta=delta, logprobs=shown)

    def _add(self, item: OutputItem) -> list[Event]:
        self.response.output.append(item)
        self._open = item
        index = len(self.response.output) - 1
        return [self._event("response.output_item.added", output_index=index, item=item.model_dump(mode="json"))]

    def _close(self, status: ItemStatus, events: bool = True, phase: Phase = "commentary") -> list[Event]:
        """End the open item; a message's ``phase`` says whether more output (tool calls) follows it."""
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        if isinstance(item, OutputMessage):
            item.phase = phase
        if not events:
            return []
        index = self.response.output.index(item)
        done: list[Event] = []
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        if isinstance(item, OutputMessage):
            part = item.content[0]
            logprobs = [logprob.model_dump(mode="json") for logprob in part.logprobs]
            done.append(self._event("response.output_text.done", **where, text=part.text, logprobs=logprobs))
            done.append(self._event("response.content_part.done", **where, part=part.model_dump(mode="json")))
        elif isinstance(item, ReasoningItem):
            done.append(self._event("response.reasoning_text.done", **where, text=item.content[0].text))
        else:
            done.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        done.append(self._event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")))
        return done

    # -- events --------------------------------------------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        item = self._open
        assert item is not None  # only called with an item open
        return {"item_id": item.id, "output_index": len(self.response.output) - 1, "content_index": 0}

    def _with_response(self, kind: str) -> Event:
        return self._event(kind, response=self.response.model_dump(mode="json"))

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
