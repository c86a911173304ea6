"""The gateway's view of the swarm: who serves which blocks, read from the DHT and kept briefly."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from hivemind import DHT

from shared.dht_records import NodeState, ServerRecord, fetch_announcements
from shared.reachability import Reachability

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwarmView:
    num_blocks: int
    servers: dict[str, ServerRecord]
    fetched_at: float = field(default_factory=time.monotonic)
    announced: dict[str, float] = field(default_factory=dict)  # peer -> its record's expiration (grows per announce)

    def online(self) -> list[ServerRecord]:
        """Nodes that serve and that peers can dial (directly or through a relay): a record of a node nobody can
        dial is not coverage."""
        return [
            s
            for s in self.servers.values()
            if s.state is NodeState.ONLINE and s.reachability is not Reachability.UNREACHABLE
        ]

    def servers_for(self, block: int, adapter: str | None = None) -> list[ServerRecord]:
        """Who serves ``block`` (with ``adapter``, when one is named)."""
        return [s for s in self.online() if s.start <= block < s.end and (adapter is None or adapter in s.adapters)]

    def missing_blocks(self, adapter: str | None = None) -> list[int]:
        return [block for block in range(self.num_blocks) if not self.servers_for(block, adapter)]

    def longest_session(self) -> int | None:
        """Tokens of the longest session some chain can hold: for each block the largest pool among its nodes, the
        smallest of those over the blocks; None while a block has no node or no node of it says its pool's size."""
        room = [max((s.cache_tokens_total for s in self.servers_for(b)), default=0) for b in range(self.num_blocks)]
        return min(room) if room and min(room) > 0 else None


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

    async def view(self, fresh: bool = False, max_age: float | None = None, stale_ok: float = 0.0) -> SwarmView:
        """A view at most ``max_age`` seconds old (default: the monitor's), or a new one if ``fresh``.

        ``stale_ok``: a view older than that but younger than ``stale_ok`` seconds is returned at once while a new
        one is fetched in the background — a request does not wait on the DHT (several round trips to nodes across
        the world) for records that rarely change; the failover path asks for fresh views."""
        held = self._view
        if not fresh and held is not None and time.monotonic() - held.fetched_at <= stale_ok:
            aged = time.monotonic() - held.fetched_at > (self._max_age if max_age is None else max_age)
            if aged and (self._refresh is None or self._refresh.done()):
                self._refresh = asyncio.create_task(self._refetch(max_age))
            return held
        async with self._lock:
            limit = self._max_age if max_age is None else max_age
            stale = self._view is None or time.monotonic() - self._view.fetched_at > limit
            if fresh or stale:
                began = time.monotonic()  # the records may be older than the fetch's end, not than its start
                servers, announced = await fetch_announcements(self._dht, self._model, self._num_blocks)
                self._view = SwarmView(self._num_blocks, servers, began, announced)
            assert self._view is not None  # set just above when missing
            return self._view

    async def _refetch(self, max_age: float | None) -> None:
        try:
            await self.view(max_age=max_age)
        except Exception:  # the next request tries again
            logger.warning("refreshing the swarm view failed; routing keeps the last one", exc_info=True)
