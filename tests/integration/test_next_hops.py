"""A node's next-hop probe reads the DHT key of its end block and no other (it runs at every announcement), and picks
the first servers of that block by peer id from what is really stored there."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from shared.dht_process import start_dht, stop_dht
from shared.dht_records import NodeState, ServerRecord, block_key, record_json
from swarm_node.next_hops import NEXT_HOPS_PROBED, next_hops

pytestmark = pytest.mark.timeout(120)

MODEL = "next-hops-test"
SPANS = {  # peer: span, over 9 blocks
    "p0": (0, 3), "p1": (3, 6), "p2": (2, 5), "p3": (3, 9), "p4": (1, 4), "p5": (3, 7), "p6": (3, 5), "p7": (6, 9),
    "p8": (4, 9),
}  # fmt: skip
END = 3  # the probing node's end block: p1, p2, p3, p4, p5, p6 serve it (p0 ends there, p7 and p8 start after)
MOVED = "p9"  # stored under block 3 but now serving 5:8 (a node that moved): not a server of block 3


async def _store(dht: DHT, node: DHTNode, *, keys: list[str], subkeys: list[bytes], values: list[Any]) -> None:
    await node.store_many(keys, values, get_dht_time() + 60, subkeys=subkeys)


def record(peer: str, start: int, end: int) -> ServerRecord:
    return ServerRecord(peer_id=peer, start=start, end=end, state=NodeState.ONLINE, version="t", protocol=1)


async def test_the_probe_reads_only_its_end_blocks_key(monkeypatch: pytest.MonkeyPatch) -> None:
    dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False)
    try:
        stored = [(block, peer, record(peer, *span)) for peer, span in SPANS.items() for block in range(*span)]
        stored.append((END, MOVED, record(MOVED, 5, 8)))
        await dht.run_coroutine(
            partial(
                _store,
                keys=[block_key(MODEL, block) for block, _, _ in stored],
                subkeys=[peer.encode() for _, peer, _ in stored],  # plain subkeys: this DHT has no validators
                values=[record_json(r) for _, _, r in stored],
            ),
            return_future=True,
        )
        asked: list[list[str]] = []
        real: Callable[..., Awaitable[Any]] = dht.run_coroutine

        def counting(coroutine: partial[Any], return_future: bool = False) -> Awaitable[Any]:
            asked.append(coroutine.keywords["keys"])
            return real(coroutine, return_future=return_future)

        monkeypatch.setattr(dht, "run_coroutine", counting)
        chosen = await next_hops(dht, MODEL, END, me="p2")
        assert asked == [[block_key(MODEL, END)]]
        assert [s.peer_id for s in chosen] == ["p1", "p3", "p4", "p5", "p6"][:NEXT_HOPS_PROBED]
    finally:
        stop_dht(dht)
