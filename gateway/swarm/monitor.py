"""Reads the swarm view from the DHT and keeps it briefly (the view itself is plain data: ``view``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hivemind import DHT

from gateway.swarm.view import SwarmView
from shared.dht_records import fetch_announcements

logger = logging.getLogger(__name__)


class SwarmMonitor:
    """Reads the model's server records from the DHT; callers get a view at most ``max_age`` seconds old."""

    def __init__(self, dht: DHT, model: str, num_blocks: int, max_age: float) -> None:
        self._dht = dht
        self._model = model
        self._num_blocks = num_blocks
        self._max_age = max_age
        self._view: SwarmView | None = None
        self._lock = asyncio.Lock()
        self._refresh: asyncio.Task[None] | None = None
        self.on_lookup: Callable[[float], None] | None = None  # told each DHT lookup's seconds (the engine wires it)

    async def view(self, fresh: bool = False, max_age: float | None = None, stale_ok: float = 0.0) -> SwarmView:
        """A view at most ``max_age`` seconds old (default: the monitor's), or if ``fresh`` one whose lookup began
        after this call.

        ``stale_ok``: a view older than that but younger than ``stale_ok`` seconds is returned at once while a new
        one is fetched in the background — a request does not wait on the DHT (several round trips to nodes across
        the world) for records that rarely change; the failover path asks for fresh views."""
        asked = time.monotonic()
        held = self._view
        if not fresh and held is not None and asked - held.fetched_at <= stale_ok:
            aged = time.monotonic() - held.fetched_at > (self._max_age if max_age is None else max_age)
            if aged and (self._refresh is None or self._refresh.done()):
                self._refresh = asyncio.create_task(self._refetch(max_age))
            return held
        async with self._lock:
            limit = self._max_age if max_age is None else max_age
            stale = self._view is None or time.monotonic() - self._view.fetched_at > limit
            # Fresh means read after the caller asked: a lookup that began since then (another caller's, while this
            # one waited on the lock) is one. Failovers ask together after a node dies (every session through it);
            # without this they read the DHT one after another, each waiting for all the lookups before its own.
            if stale or (fresh and (self._view is None or self._view.fetched_at < asked)):
                began = time.monotonic()  # the records may be older than the fetch's end, not than its start
                servers, announced = await fetch_announcements(self._dht, self._model, self._num_blocks)
                if self.on_lookup is not None:
                    self.on_lookup(time.monotonic() - began)
                self._view = SwarmView(self._num_blocks, servers, began, announced)
            assert self._view is not None  # set just above when missing
            return self._view

    async def _refetch(self, max_age: float | None) -> None:
        try:
            await self.view(max_age=max_age)
        except Exception:  # the next request tries again
            logger.warning("refreshing the swarm view failed; routing keeps the last one", exc_info=True)
