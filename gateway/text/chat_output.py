"""One chat choice's generated text split into what OpenAI's message has: reasoning, content and tool calls.

    text piece ─ReasoningParser→ reasoning_content | rest ─ToolCallParser→ content | tool-call deltas

The same parser serves a stream (piece by piece) and a whole response (the choice's text at once), so a stream's
deltas add up to the whole response's fields. Callable from any serving class.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.text.reasoning import ReasoningParser
from gateway.text.tool_parsers import ToolCall, ToolCallDelta, ToolCallParser, ToolFormat


@dataclass(frozen=True)
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, later: OutputDelta) -> OutputDelta:
        return OutputDelta(self.reasoning + later.reasoning, self.content + later.content, self.calls + later.calls)


@dataclass
class ChatOutputParser:
    reasoning: ReasoningParser | None = None  # None: the model does not think in tags
    tools: ToolCallParser | None = None  # None: no tools offered, all text is content

    @classmethod
    def build(cls, reasoning: bool, reasoning_inside: bool, tool_format: ToolFormat | None) -> ChatOutputParser:
        return cls(
            ReasoningParser(reasoning_inside) if reasoning else None,
            ToolCallParser(tool_format) if tool_format is not None else None,
        )

    def feed(self, text: str) -> OutputDelta:
        reasoning, rest = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._tools(reasoning, rest, final=False)

    def finish(self) -> OutputDelta:
        reasoning, rest = self.reasoning.finish() if self.reasoning else ("", "")
        return self._tools(reasoning, rest, final=True)

    def feed_piece(self, text: str, last: bool) -> OutputDelta:
        """``feed``, and on a choice's last piece ``finish`` too (what the parser held back comes out)."""
        delta = self.feed(text)
        return delta + self.finish() if last else delta

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools else []

    def _tools(self, reasoning: str, rest: str, final: bool) -> OutputDelta:
        if self.tools is None:
            return OutputDelta(reasoning, rest)
        parsed = self.tools.feed(rest)
        content, calls = parsed.content, parsed.calls
        if final:
            last = self.tools.finish()
            content, calls = content + last.content, calls + last.calls
        return OutputDelta(reasoning, content, calls)
