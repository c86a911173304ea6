"""Finished chats kept warm: their node sessions stay open a while, so the next turn prefills only what is new.

    turn 1: prompt ─prefill, generate→ keep(scope, ids the nodes hold, chain)
    turn 2: prompt ─take(scope, prompt)→ longest common prefix with a kept conversation → rewind there, prefill the rest

Bookkeeping only, no I/O: what is kept, for whom, until when. The engine opens, resizes and closes the chains it
gets back. A taken conversation leaves the pool, so one request at a time uses it; it comes back only when that
request ends well.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

Clock = Callable[[], float]

# A conversation is taken only by a prompt that continues at least this share of what it holds: a new chat sharing
# just the system prompt would otherwise take (and rewind) another conversation's caches for a few tokens' gain.
MIN_SHARED_FRACTION = 0.5


@dataclass(frozen=True)
class Kept(Generic[T]):
    scope: str  # whose conversation: requests of other scopes never see it
    token_ids: tuple[int, ...]  # what the nodes' caches hold, position by position
    item: T
    kept_at: float


@dataclass(frozen=True)
class Taken(Generic[T]):
    item: T
    prefix: int  # leading prompt tokens the caches already hold (always leaves one to prefill: it gives the logits)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


class ConversationPool(Generic[T]):
    """At most ``max_kept`` conversations, each for ``keep_alive`` seconds after it was kept (0: none kept)."""

    def __init__(self, keep_alive: float, max_kept: int, clock: Clock = time.monotonic) -> None:
        self.keep_alive = keep_alive
        self.max_kept = max_kept
        self._clock = clock
        self._kept: list[Kept[T]] = []  # least recently kept first

    @property
    def enabled(self) -> bool:
        return self.keep_alive > 0 and self.max_kept > 0

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, scope: str, prompt_ids: Sequence[int]) -> Taken[T] | None:
        """The scope's kept conversation sharing the longest prefix with ``prompt_ids``, out of the pool."""
        deadline = self._clock() - self.keep_alive
        best: tuple[int, Kept[T]] | None = None
        for kept in self._kept:
            if kept.scope != scope or kept.kept_at < deadline:
                continue
            prefix = min(common_prefix(kept.token_ids, prompt_ids), len(prompt_ids) - 1)
            if prefix <= 0 or prefix < MIN_SHARED_FRACTION * len(kept.token_ids):
                continue
            if best is None or prefix >= best[0]:  # ties: the most recently kept
                best = (prefix, kept)
        if best is None:
            return None
        self._remove([best[1]])
        return Taken(best[1].item, best[0])

    def keep(self, scope: str, token_ids: Sequence[int], item: T) -> list[T]:
        """Keep ``item`` (a chain whose caches hold ``token_ids``); returns what must be closed now: the least
        recently kept beyond ``max_kept`` — or ``item`` itself when nothing is kept at all."""
        if not self.enabled:
            return [item]
        self._kept.append(Kept(scope, tuple(token_ids), item, self._clock()))
        return self._remove(self._kept[: max(0, len(self._kept) - self.max_kept)])

    def expired(self) -> list[T]:
        """Remove and return the conversations kept longer than ``keep_alive``."""
        deadline = self._clock() - self.keep_alive
        return self._remove([kept for kept in self._kept if kept.kept_at < deadline])

    def remove_if(self, predicate: Callable[[T], bool]) -> list[T]:
        """Remove and return the conversations whose item matches ``predicate``."""
        return self._remove([kept for kept in self._kept if predicate(kept.item)])

    def clear(self) -> list[T]:
        return self._remove(list(self._kept))

    def _remove(self, gone: list[Kept[T]]) -> list[T]:
        ids = {id(kept) for kept in gone}
        self._kept = [kept for kept in self._kept if id(kept) not in ids]
        return [kept.item for kept in gone]
