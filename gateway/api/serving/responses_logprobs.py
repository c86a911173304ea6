"""The token logprobs of a response's message text (``include: ["message.output_text.logprobs"]``), picked out of a
choice's tokens as the chat output parser splits their text into reasoning, message text and tool calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.api.protocol.chat import TokenLogprob
from gateway.text.assembler import EmittedToken
from gateway.text.chat_output import OutputDelta


class MessageLogprobs:
    """Which tokens' logprobs go with the message text (``include: ["message.output_text.logprobs"]``): those whose
    text the parser gave to the message, not those of reasoning or of a tool call's markup. The parser says only
    what text it gave where; the text it wrote as content is the latest occurrence of it in the choice's text not
    yet given (it may hold back what follows, a tool call's markup that may be starting), and the tokens that
    overlap it are its tokens (``EmittedToken.offset``: where each starts in the choice's text)."""

    def __init__(self, convert: Callable[[Sequence[EmittedToken]], list[TokenLogprob]]) -> None:
        self._convert = convert
        self._text = ""  # the choice's text from ``_start`` on: not given to the message yet
        self._start = 0
        self._waiting: list[EmittedToken] = []  # tokens that may still be the message's, by offset

    def of(self, text: str, tokens: Sequence[EmittedToken], out: OutputDelta) -> list[TokenLogprob]:
        """The logprobs for ``out``'s content, after a piece of ``text`` carrying ``tokens`` was parsed into it."""
        self._text += text
        self._waiting += tokens
        if not out.content:
            return []
        found = self._text.rfind(out.content)
        begin = self._start + max(found, 0)  # not found verbatim: every waiting token is its
        end = begin + len(out.content) if found >= 0 else self._start + len(self._text)
        taken, kept = [], []
        for i, token in enumerate(self._waiting):
            after = self._waiting[i + 1].offset if i + 1 < len(self._waiting) else None  # where its text ends
            if token.offset >= end:
                kept.append(token)
            elif after is None or after > begin:
                taken.append(token)
        self._waiting, self._text, self._start = kept, self._text[end - self._start :], end
        return self._convert(taken)
