"""The gateway's view of the swarm: who serves which blocks, as plain data (``monitor`` reads it from the DHT)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from shared.server_records import NodeState, Reachability, ServerRecord


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
        return [s for s in self._by_block.get(block, ()) if adapter is None or adapter in s.adapters]

    def serving(self, start: int, end: int, adapter: str | None = None) -> list[ServerRecord]:
        """Who serves some block of [start, end) (with ``adapter``, when one is named)."""
        return [
            s for s in self.online() if s.start < end and s.end > start and (adapter is None or adapter in s.adapters)
        ]

    @functools.cached_property
    def _by_block(self) -> dict[int, list[ServerRecord]]:
        # Built once per view (a view is immutable): per-block questions cost the block's servers, not the swarm's.
        index: dict[int, list[ServerRecord]] = {}
        for server in self.online():
            for block in range(server.start, min(server.end, self.num_blocks)):
                index.setdefault(block, []).append(server)
        return index

    def missing_blocks(self, adapter: str | None = None) -> list[int]:
        return [block for block in range(self.num_blocks) if not self.servers_for(block, adapter)]

    def longest_session(self) -> int | None:
        """Tokens of the longest session some chain can hold: for each block the largest pool among its nodes, the
        smallest of those over the blocks; None while a block has no node or no node of it says its pool's size."""
        room = [max((s.cache_tokens_total for s in self.servers_for(b)), default=0) for b in range(self.num_blocks)]
        return min(room) if room and min(room) > 0 else None
