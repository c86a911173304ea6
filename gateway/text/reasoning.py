"""Reasoning split from the answer for models that think in tags (``<think>...</think>``: Qwen3, DeepSeek-R1).

``ReasoningParser.feed`` takes text as it is generated and returns (reasoning, content) that are settled: text that
might be the start of a tag is held back until the next piece decides. Two ways a model starts thinking:

* explicitly: its output opens with ``<think>`` (Qwen3);
* implicitly: the chat template already wrote ``<think>`` at the end of the prompt (DeepSeek-R1, Qwen3 thinking
  models), so the output is reasoning until ``</think>``. ``starts_inside`` tells the parser which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OPEN, CLOSE = "<think>", "</think>"
ReasoningParserName = Literal["auto", "none", "qwen3", "deepseek_r1"]


def reasoning_enabled(configured: ReasoningParserName, template: str | None) -> bool:
    """``auto``: split when the chat template knows ``</think>`` (a thinking model's template does)."""
    if configured == "auto":
        return CLOSE in (template or "")
    return configured != "none"


def starts_inside(prompt: str) -> bool:
    """Whether the rendered prompt already opened the reasoning (its last tag is an unclosed ``<think>``)."""
    return prompt.rstrip().endswith(OPEN)


@dataclass
class ReasoningParser:
    inside: bool = False  # the prompt already opened the reasoning
    _buffer: str = ""
    _state: Literal["start", "reasoning", "gap", "content"] = "start"  # gap: blanks after </think>

    def __post_init__(self) -> None:
        if self.inside:
            self._state = "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        """-> (reasoning, content) settled by ``text``."""
        self._buffer += text
        reasoning = content = ""
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if not stripped or (len(stripped) < len(OPEN) and OPEN.startswith(stripped)):
                return "", ""  # maybe "<think>": wait
            if stripped.startswith(OPEN):
                self._buffer, self._state = stripped[len(OPEN) :], "reasoning"
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = self._buffer.find(CLOSE)
            if at < 0:
                hold = _partial(self._buffer, CLOSE)
                reasoning, self._buffer = (
                    self._buffer[: len(self._buffer) - hold],
                    self._buffer[len(self._buffer) - hold :],
                )
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:at], self._buffer[at + len(CLOSE) :]
            self._state = "gap"
        if self._state == "gap":
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return reasoning, ""
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


def _partial(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
