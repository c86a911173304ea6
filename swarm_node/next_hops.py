"""Which nodes a node measures round trips to and announces (``ServerRecord.next_rtts``): the first servers of its
end block by peer id, where a session it serves most likely goes next. The gateway prices a push over those links.

Read from the end block's DHT key alone: the probe runs at every announcement (every 10 s by default), and reading
every block's key instead cost a node of a 1,000-node swarm about 60 MB a minute (``sim/dht_traffic.py``).
"""

from __future__ import annotations

from hivemind import DHT

from shared.dht_records import ServerRecord, fetch_block_servers

NEXT_HOPS_PROBED = 4  # nodes serving our end block whose round-trip time we measure and announce


async def next_hops(dht: DHT, model: str, end: int, me: str) -> list[ServerRecord]:
    """Up to ``NEXT_HOPS_PROBED`` servers of block ``end`` other than ``me``, by peer id (so nodes ending at the same
    block measure the same ones, and the gateway compares like with like)."""
    servers = await fetch_block_servers(dht, model, [end])
    serving = (s for s in servers.values() if s.start <= end < s.end and s.peer_id != me)
    return sorted(serving, key=lambda s: s.peer_id)[:NEXT_HOPS_PROBED]
