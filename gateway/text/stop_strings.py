"""Stop strings over streamed text: found even when they span tokens, never returned, never half-streamed."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = sorted({stop for stop in stops if stop})
        self.longest = max((len(stop) for stop in self.stops), default=0)

    def find(self, text: str, new_from: int) -> int | None:
        """Where the earliest stop string starts, if one ends in ``text[new_from:]`` (the text added last)."""
        found = self.match(text, new_from)
        return None if found is None else found[0]

    def match(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The earliest stop string ending in ``text[new_from:]``, and where it starts (Anthropic names it)."""
        if not self.stops:
            return None
        # A stop that ends in the new text may begin up to ``longest - 1`` characters before it.
        start = max(0, new_from - self.longest + 1)
        found = [(index, stop) for stop in self.stops if (index := text.find(stop, start)) != -1]
        return min(found) if found else None

    def holdback(self, text: str) -> int:
        """How many trailing characters of ``text`` could still become a stop string (so must not be sent yet)."""
        for size in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0
