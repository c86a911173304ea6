"""Nodes that failed are avoided for a while: 15·2^k seconds after k earlier consecutive failures, capped at
``max_seconds`` (5 minutes by default: a node that misbehaved an hour ago deserves another chance, and a burst of
failures in one second must not bench it for a day).

Only faults ban (see recovery.py): a node saying it is full or draining is healthy. A success resets a node's count.
Routing ignores bans for a block whose every server is banned (see routing.py), so a swarm that only has flaky nodes
left still serves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_BAN_SECONDS = 300.0


@dataclass(frozen=True)
class BanStatus:
    failures: int
    banned_for: float  # seconds left; 0 when not banned


class BanList:
    def __init__(
        self,
        base_seconds: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        max_seconds: float = MAX_BAN_SECONDS,
    ) -> None:
        self._base = base_seconds
        self._max = max_seconds
        self._clock = clock
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def record_failure(self, peer_id: str) -> float:
        """Ban ``peer_id``; returns the ban's length in seconds."""
        earlier = self._failures.get(peer_id, 0)
        duration = min(self._max, self._base * 2 ** min(earlier, 32))  # the exponent is capped too: no overflow
        self._failures[peer_id] = earlier + 1
        self._until[peer_id] = self._clock() + duration
        return duration

    def record_success(self, peer_id: str) -> None:
        self._failures.pop(peer_id, None)
        self._until.pop(peer_id, None)

    def banned(self) -> frozenset[str]:
        now = self._clock()
        return frozenset(peer for peer, until in self._until.items() if until > now)

    def status(self, peer_id: str) -> BanStatus:
        left = max(0.0, self._until.get(peer_id, 0.0) - self._clock())
        return BanStatus(self._failures.get(peer_id, 0), left)
