"""The virtual clock: a heap of (time, order, action); time moves only from one event to the next."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were scheduled: reproducible

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(time, self.now), next(self._order), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def run_until(self, end: float) -> None:
        while self._heap and self._heap[0][0] <= end:
            self.now, _, action = heapq.heappop(self._heap)
            action()
        self.now = end
