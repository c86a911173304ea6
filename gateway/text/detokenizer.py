"""Incremental detokenization: the text of a growing token sequence, as deltas that never split a character.

Decoding tokens one at a time is wrong twice over: a byte-level token may hold half of a UTF-8 character (decoded
alone it is U+FFFD), and tokenizers that mark word starts (sentencepiece's ``▁``) drop a leading space when a token
is decoded without its left neighbour. So each step decodes a short window — a few tokens already emitted plus the
new ones — and hands out only what the new tokens added, holding it back while it ends in an incomplete character.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # tokens before the new ones decoded with them, so boundary spaces and merges come out right


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, context_ids: Sequence[int] = ()) -> None:
        self._decoder = decoder
        self._ids = list(context_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # window start: already emitted tokens kept as context
        self._read = len(self._ids)  # first token whose text is not emitted yet

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes (often '' while a character is still partial)."""
        self._ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Everything still held back (an incomplete character comes out as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decoder.decode(self._ids[self._prefix : self._read])
        after = self._decoder.decode(self._ids[self._prefix :])
        if len(after) <= len(before) and not final:
            return ""
        if after.endswith(REPLACEMENT) and not final:
            return ""
        # ``after`` normally starts with ``before``; when the context itself ended mid-character it does not,
        # and the common prefix is the part already emitted.
        shared = len(before) if after.startswith(before) else len(os.path.commonprefix([before, after]))
        # The tokens just emitted become the next window's context.
        self._prefix, self._read = self._read, len(self._ids)
        return after[shared:]
