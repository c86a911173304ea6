"""When each running session's next request is expected, from the rhythm of its previous ones.

The batching primitive (``shared.batching``) reads it under the node's decode batcher (one forward of the span for
many sessions) and the gateway's LM head (one matmul for many sessions): a batch that opens waits only for the
sessions that are *due* before a short deadline, never for ones that are elsewhere in the chain for longer, and a
lone stream never waits.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from dataclasses import dataclass
from typing import Generic, TypeVar

ACTIVE_HORIZON = 1.0  # a session counts as running until this long (or two of its intervals) after its last request
RHYTHM_SMOOTHING = 0.5  # weight of the newest interval in a session's running estimate

Key = TypeVar("Key")  # one object per session, weakly referenced: a dropped session drops its rhythm


@dataclass
class _Rhythm:
    last: float  # when the session's latest request arrived
    interval: float | None = None  # running estimate of the time between its requests


class ArrivalForecast(Generic[Key]):
    def __init__(self) -> None:
        self._rhythms: weakref.WeakKeyDictionary[Key, _Rhythm] = weakref.WeakKeyDictionary()

    def arrived(self, key: Key, now: float) -> None:
        rhythm = self._rhythms.get(key)
        if rhythm is None:
            self._rhythms[key] = _Rhythm(now)
            return
        interval = now - rhythm.last
        if rhythm.interval is not None:
            interval = RHYTHM_SMOOTHING * interval + (1 - RHYTHM_SMOOTHING) * rhythm.interval
        rhythm.last, rhythm.interval = now, interval

    def forget(self, key: Key) -> None:
        """The session ended: nobody should wait for it (before its key is garbage-collected)."""
        self._rhythms.pop(key, None)

    def running(self, now: float) -> int:
        """Sessions that still run: their latest request was recent, judged by their own rhythm."""
        return sum(1 for rhythm in list(self._rhythms.values()) if self._running(rhythm, now))

    def due(self, now: float, until: float, present: Collection[Key]) -> int:
        """Sessions not ``present`` that still run and whose next request is expected by ``until`` (one overdue by
        more than its interval is stalled or gone, not due)."""
        count = 0
        for key, rhythm in list(self._rhythms.items()):
            if key in present or rhythm.interval is None:
                continue
            expected = rhythm.last + rhythm.interval
            if self._running(rhythm, now) and now - expected <= rhythm.interval and expected <= until:
                count += 1
        return count

    @staticmethod
    def _running(rhythm: _Rhythm, now: float) -> bool:
        return now - rhythm.last <= max(ACTIVE_HORIZON, 2 * (rhythm.interval or 0.0))
