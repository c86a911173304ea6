"""One choice's generated tokens turned into the text pieces a client receives.

    GeneratedToken ─IncrementalDetokenizer→ text delta ─StopMatcher→ Piece(text that is final, its tokens)

A piece carries only text that can no longer change: characters that might begin a stop string are held back until
the next token settles it, and when a stop string completes, the text is cut where it begins. Each token keeps the
offset where its text starts, so logprobs travel in the same piece as their text. End-of-sequence tokens count as
generated but add no text and no logprob entry (OpenAI returns neither) — unless the request said ``ignore_eos``:
then an end token is an ordinary token (its text, usually empty, and its logprob), at any position, the first too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.generation import GeneratedToken
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopMatcher

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class EmittedToken:
    token: GeneratedToken
    offset: int  # where this token's text starts in the choice's generated text


@dataclass(frozen=True)
class Piece:
    text: str
    tokens: tuple[EmittedToken, ...] = ()
    finish_reason: FinishReason | None = None  # set on a choice's last piece only
    stop: str | None = None  # on the last piece: the stop string that ended the choice, if one did

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens or self.finish_reason)


@dataclass
class TextAssembler:
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    ignore_eos: bool = False  # end tokens are ordinary tokens: only stop strings and the length end the choice
    text: str = ""  # generated text so far (cut at a stop string once one is found)
    generated: int = 0  # tokens the engine produced, EOS included (the usage count)
    logprob_sum: float = 0.0  # of the emitted tokens, for best_of ranking
    finish_reason: FinishReason | None = None
    stop: str | None = None  # the stop string found, if one was
    _sent: int = 0  # characters of ``text`` already handed out
    _cut: bool = False  # a stop string was found and the text cut there
    _pending: list[EmittedToken] = field(default_factory=list)

    @property
    def stopped(self) -> bool:
        """A stop condition was met: the caller should end the generation."""
        return self.finish_reason is not None

    def add(self, token: GeneratedToken) -> Piece:
        self.generated += 1
        if token.eos and not self.ignore_eos:
            self.finish_reason = "stop"
            return Piece("")
        start = len(self.text)
        self.text += self.detokenizer.push(token.token_id)
        self._pending.append(EmittedToken(token, start))
        if token.logprob is not None:
            self.logprob_sum += token.logprob
        return self._settle(start)

    def finish(self) -> Piece:
        """The choice's last piece: whatever was held back, and why it ended (``length`` unless it stopped)."""
        if self._cut:
            return Piece("", (), "stop", self.stop)
        start = len(self.text)
        self.text += self.detokenizer.flush()
        piece = self._settle(start, final=True)
        if not self._cut:
            piece = self._take(len(self.text), everything=True)
        return Piece(piece.text, piece.tokens, self.finish_reason or "length")

    def _settle(self, new_from: int, final: bool = False) -> Piece:
        found = self.stops.match(self.text, new_from)
        if found is not None:
            cut, self.stop = found
            self.text = self.text[:cut]
            self.finish_reason, self._cut = "stop", True
            piece = self._take(cut)
            self._pending = []  # tokens after the stop string are not returned
            return piece
        if final:
            return Piece("")
        return self._take(len(self.text) - self.stops.holdback(self.text))

    def _take(self, end: int, everything: bool = False) -> Piece:
        """Hand out text up to ``end`` with the tokens whose text starts before it."""
        text = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        ready = tuple(t for t in self._pending if everything or t.offset < end)
        self._pending = [t for t in self._pending if not (everything or t.offset < end)]
        return Piece(text, ready)
