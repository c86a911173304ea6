"""Tool calls in generated text: parsed incrementally into OpenAI's ``tool_calls`` deltas, and forced by a grammar.

Three formats, each a way to write ``{"name": ..., "arguments": {...}}`` objects in text:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Hermes, Qwen 2.5/3; our default)
    llama3_json  {"name": "f", "parameters": {...}}; {...}                  (Llama 3.1+, output that opens with "{")
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]        (Mistral; the marker may be stripped)

``ToolCallParser.feed`` takes text as it is generated and returns what is settled: plain content, and per call first
its id and name, then its arguments in pieces — the raw JSON text the model wrote, so a stream's pieces add up to
the arguments of the same call parsed whole (a non-streamed response runs the same parser over the whole text).
``forced_grammar`` is the Lark grammar (llguidance's dialect, with ``%json`` for each function's parameter schema)
that makes a model write one or more valid calls: ``tool_choice`` ``required`` or a named function.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.generation import Grammar

FormatName = Literal["hermes", "llama3_json", "mistral"]
PARSER_NAMES: tuple[FormatName, ...] = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolFormat:
    name: FormatName
    open_markers: tuple[str, ...]  # text that starts the tool-call part of the output
    skipped: tuple[str, ...]  # markers and separators between calls
    arguments_key: str
    bare_start: str | None = None  # the output's first non-blank character that alone starts its calls


FORMATS: dict[FormatName, ToolFormat] = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), ("<tool_call>", "</tool_call>"), "arguments"),
    "llama3_json": ToolFormat("llama3_json", ("<|python_tag|>",), (";", "<|python_tag|>"), "parameters", "{"),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), ("[TOOL_CALLS]", "[", ",", "]"), "arguments", "["),
}


@dataclass(frozen=True)
class FunctionSpec:
    """A tool as the grammar and the default prompt need it (plain data from the request's ``tools``)."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # which call of the choice
    id: str | None = None  # with the name, on a call's first delta only
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ParsedText:
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


def choose_format(template: str | None, configured: str | None) -> ToolFormat:
    """``--tool-call-parser`` if set, else the format the chat template writes calls in (hermes by default)."""
    if configured:
        return FORMATS[configured]  # type: ignore[index]  # settings restrict the name to PARSER_NAMES
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return FORMATS["mistral"]
    if "<|python_tag|>" in text or ("parameters" in text and "<|eom_id|>" in text):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Call:
    """A call's JSON object being read: where it is, and how far its arguments were handed out."""

    index: int
    start: int  # where its object starts in the parser's text
    id: str = field(default_factory=new_call_id)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    key: str | None = None  # the top-level key whose value is being read
    reading_key: bool = False
    key_start: int = 0
    value_start: int | None = None
    name: str | None = None
    announced: bool = False
    arguments_from: int | None = None  # where the arguments' raw text starts
    arguments_end: int | None = None  # where it ends, once known
    arguments_sent: int = 0  # characters of it already handed out


@dataclass
class ToolCallParser:
    """One choice's output split into content and tool-call deltas, text piece by text piece."""

    format: ToolFormat
    calls: list[ToolCall] = field(default_factory=list)  # in order; after ``finish`` the last may be cut short
    _text: str = ""
    _pos: int = 0  # characters of ``_text`` consumed
    _mode: Literal["start", "text", "between", "call"] = "start"
    _call: _Call | None = None
    _count: int = 0

    def feed(self, text: str) -> ParsedText:
        self._text += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return ParsedText("".join(content), tuple(deltas))

    def finish(self) -> ParsedText:
        """The rest at the end of the output: held-back text is content; an unfinished call keeps what it had."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        call = self._call
        if call is not None and call.announced:  # cut short (the length limit): kept with what it had, as streamed
            deltas += self._arguments(call, len(self._text))
            self.calls.append(ToolCall(call.id, call.name or "", self._arguments_text(call)))
        elif call is not None:
            content.append(self._text[call.start :])  # no call after all: the text goes back to the user
        elif self._mode in ("start", "text"):
            content.append(self._text[self._pos :])
        self._pos, self._call = len(self._text), None
        return ParsedText("".join(content), tuple(deltas))

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consume what can be decided now; False when more text is needed."""
        rest = self._text[self._pos :]
        if self._mode == "start":
            stripped = rest.lstrip()
            if not stripped:
                return False
            bare = self.format.bare_start
            self._mode = "between" if bare is not None and stripped.startswith(bare) else "text"
            return True
        if self._mode == "text":
            return self._step_text(rest, content)
        if self._mode == "between":
            return self._step_between(rest)
        return self._step_call(content, deltas)

    def _step_text(self, rest: str, content: list[str]) -> bool:
        found = [(rest.find(m), m) for m in self.format.open_markers if m in rest]
        if found:
            at, marker = min(found)
            content.append(rest[:at])
            self._pos += at + len(marker)
            self._mode = "between"
            return True
        hold = _partial_suffix(rest, self.format.open_markers)
        content.append(rest[: len(rest) - hold])
        self._pos += len(rest) - hold
        return False

    def _step_between(self, rest: str) -> bool:
        stripped = rest.lstrip()
        self._pos += len(rest) - len(stripped)
        if not stripped:
            return False
        if any(len(stripped) < len(m) and m.startswith(stripped) for m in self.format.skipped):
            return False  # maybe the start of a longer marker ("[" of "[TOOL_CALLS]"): wait
        for marker in self.format.skipped:
            if stripped.startswith(marker):
                self._pos += len(marker)
                return True
        if stripped.startswith("{"):
            self._call = _Call(self._count, self._pos)
            self._count += 1
            self._mode = "call"
            return True
        self._mode = "text"  # anything else is the user's text again
        return True

    def _step_call(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        call = self._call
        if call is None:
            raise RuntimeError("no call is being read")
        while self._pos < len(self._text):
            char = self._text[self._pos]
            self._pos += 1
            if self._scan(call, char, deltas):
                closed = self._close(call)
                if closed is None:  # not a call after all: the object is the user's text
                    content.append(self._text[call.start : self._pos])
                    self._call, self._mode = None, "text"
                    return True
                deltas += closed
                self._call, self._mode = None, "between"
                return True
        deltas += self._arguments(call, len(self._text))
        return False

    def _scan(self, call: _Call, char: str, deltas: list[ToolCallDelta]) -> bool:
        """One character of a call's JSON object; True when the object closed."""
        at = self._pos - 1
        if call.in_string:
            if call.escaped:
                call.escaped = False
            elif char == "\\":
                call.escaped = True
            elif char == '"':
                call.in_string = False
                if call.depth == 1:
                    self._string_closed(call, at, deltas)
            return False
        if char == '"':
            call.in_string = True
            if call.depth == 1 and call.key is None:
                call.reading_key, call.key_start = True, at
            elif call.depth == 1 and call.value_start is None:
                self._value_starts(call, at)
        elif char in "{[":
            call.depth += 1
            if call.depth == 2 and call.value_start is None:
                self._value_starts(call, at)
        elif char in "}]":
            call.depth -= 1
            if call.depth == 1 and call.key == self.format.arguments_key:
                call.arguments_end = at + 1
            return call.depth == 0
        elif call.depth == 1 and char == ",":
            call.key, call.value_start = None, None
        elif call.depth == 1 and not char.isspace() and char != ":" and call.value_start is None:
            self._value_starts(call, at)  # a number, true, false, null
        return False

    def _value_starts(self, call: _Call, at: int) -> None:
        call.value_start = at
        if call.key == self.format.arguments_key:
            call.arguments_from = at

    def _string_closed(self, call: _Call, at: int, deltas: list[ToolCallDelta]) -> None:
        if call.reading_key:
            call.key, call.reading_key = json.loads(self._text[call.key_start : at + 1]), False
        elif call.key == "name" and call.value_start is not None and not call.announced:
            name = json.loads(self._text[call.value_start : at + 1])
            if isinstance(name, str):
                call.name = name
                deltas += self._announce(call)
        elif call.key == self.format.arguments_key:
            call.arguments_end = at + 1  # arguments written as a JSON string

    def _announce(self, call: _Call) -> list[ToolCallDelta]:
        call.announced = True
        return [ToolCallDelta(call.index, call.id, call.name), *self._arguments(call, self._pos)]

    def _arguments(self, call: _Call, end: int) -> list[ToolCallDelta]:
        """The arguments' raw text written since the last delta (up to ``end`` or the value's own end)."""
        if not call.announced or call.arguments_from is None:
            return []
        stop = end if call.arguments_end is None else min(end, call.arguments_end)
        piece = self._text[call.arguments_from + call.arguments_sent : stop]
        call.arguments_sent += len(piece)
        return [ToolCallDelta(call.index, arguments=piece)] if piece else []

    def _close(self, call: _Call) -> list[ToolCallDelta] | None:
        """The object closed: finish its deltas and record the call (None: the object is no call)."""
        try:
            parsed = json.loads(self._text[call.start : self._pos])
        except json.JSONDecodeError:
            parsed = None
        if not call.announced:
            if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                return None
            call.name = parsed["name"]
            call.announced = True
            deltas = [ToolCallDelta(call.index, call.id, call.name)]
        else:
            deltas = []
        if call.arguments_from is None:  # no arguments written: OpenAI's empty object
            deltas.append(ToolCallDelta(call.index, arguments="{}"))
            arguments = "{}"
        else:
            deltas += self._arguments(call, self._pos)
            arguments = self._arguments_text(call)
        self.calls.append(ToolCall(call.id, call.name or "", arguments))
        return deltas

    def _arguments_text(self, call: _Call) -> str:
        """The arguments handed out so far, whole."""
        if call.arguments_from is None:
            return ""
        return self._text[call.arguments_from : call.arguments_from + call.arguments_sent]


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers`` (held back until it is decided)."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                best = max(best, size)
                break
    return best


# ---------------------------------------------------------------------------------------------------------------
# Forcing calls with a grammar, and describing tools to a template that cannot


def forced_grammar(fmt: ToolFormat, functions: Sequence[FunctionSpec], parallel: bool) -> Grammar:
    """A grammar whose every sentence is one call (``parallel``: one or more) of one of ``functions``."""
    rules = []
    options = []
    for i, function in enumerate(functions):
        head = json.dumps(f'{{"name": {json.dumps(function.name)}, "{fmt.arguments_key}": ')
        options.append(f"{head} args{i} " + json.dumps("}"))
        rules.append(f"args{i}: %json {json.dumps(_compact(function.parameters))}")
    call = "call: " + " | ".join(options)
    if fmt.name == "hermes":
        one = '"<tool_call>" call "</tool_call>"'
        start = f"start: {one}+" if parallel else f"start: {one}"
    elif fmt.name == "mistral":
        start = 'start: "[TOOL_CALLS][" call ("," call)* "]"' if parallel else 'start: "[TOOL_CALLS][" call "]"'
    else:
        start = 'start: call ("; " call)*' if parallel else "start: call"
    return Grammar("lark", "\n".join([start, call, *rules]), param="tools")


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with llguidance told to write compact JSON (no free whitespace to ramble in)."""
    guidance = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
    return {**schema, "x-guidance": guidance}


def default_tools_prompt(functions: Sequence[FunctionSpec]) -> str:
    """The system text that describes tools to a model whose chat template has no ``tools`` support (Hermes's)."""
    described = "\n".join(
        json.dumps(
            {
                "type": "function",
                "function": {"name": f.name, "description": f.description or "", "parameters": f.parameters},
            },
            ensure_ascii=False,
        )
        for f in functions
    )
    return (
        "You may call one or more functions to help with the user's request. The functions you can call:\n"
        f"<tools>\n{described}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:\n"
        '<tool_call>{"name": "<function-name>", "arguments": {<arguments-object>}}</tool_call>'
    )
