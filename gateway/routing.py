"""Route choice: which nodes carry a session's hidden states, block range by block range.

For now any chain that covers the blocks: at each block, the online server that reaches farthest. The
latency/throughput router replaces ``plan_chain`` behind this same signature.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.swarm_view import SwarmView
from shared.errors import MissingBlocks


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start: int
    end: int


def plan_chain(view: SwarmView, start: int = 0, end: int | None = None) -> list[Hop]:
    """Hops covering blocks [start, end); raises ``MissingBlocks`` naming every uncovered block."""
    end = view.num_blocks if end is None else end
    missing = [block for block in view.missing_blocks() if start <= block < end]
    if missing:
        raise MissingBlocks(missing)
    hops: list[Hop] = []
    block = start
    while block < end:
        best = max(view.servers_for(block), key=lambda s: (s.end, s.throughput, s.peer_id))
        hop_end = min(best.end, end)
        hops.append(Hop(best.peer_id, block, hop_end))
        block = hop_end
    return hops
