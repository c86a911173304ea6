"""DHT traffic a node causes by announcing and reading records, per minute, from our real records and periods.

An analytic count, not a packet trace: a record is ``record_json`` of a real ``ServerRecord`` (full-length libp2p
peer ids, four measured next hops) packed with msgpack, as hivemind stores values. Stores go to hivemind's
``num_replicas`` nearest nodes of each key; a read of a key gets its whole value (every record stored under it)
from each replica that answers. Periods are swarm_node's defaults (``sim.swarm``).

What a node reads, as ``swarm_node.server`` does: at every announcement the next-hop probe reads its end block's key
alone (``swarm_node.next_hops``), and every balance period the balance check reads every block's (it compares the
whole swarm's coverage). Before, the probe read every block's key too: 7 whole-swarm reads a minute, not 1.

``python -m sim.dht_traffic [--spans S S S]`` prints the table for 100, 300 and 1,000 nodes (mean spans as measured
by ``python -m sim``: 7.8, 5.9 and 8.0 blocks).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import msgpack

from shared.server_records import NodeState, ServerRecord, record_json
from sim.swarm import ANNOUNCE_PERIOD, BALANCE_PERIOD

REPLICAS = 5  # hivemind DHTNode's num_replicas default
READ_REPLIES = 2  # replicas that answer one key's read (a get stops once it has an unexpired value, then a second)
ENTRY_OVERHEAD = 120  # bytes per stored entry besides the value: key id, subkey, expiration, protobuf framing
LOOKUP_BYTES = 200  # bytes of one FIND request and reply while locating a key's nearest nodes
PEER_ID = "12D3KooW" + "x" * 44  # a libp2p Ed25519 peer id's length in base58


def record_bytes() -> int:
    record = ServerRecord(
        peer_id=PEER_ID, start=40, end=50, state=NodeState.ONLINE, throughput=31.4159, prefill_throughput=812.5,
        cache_tokens_left=271_828, cache_tokens_total=383_649, queue_depth=3,
        next_rtts={PEER_ID[:-1] + str(i): 0.0421 for i in range(4)}, version="0.1.0", protocol=3,
    )  # fmt: skip
    return len(msgpack.packb(record_json(record)))


@dataclass(frozen=True)
class Traffic:
    """Bytes per minute one node sends and receives for the DHT, by purpose."""

    announce: float  # its own records, stored at REPLICAS nodes per key, and the lookups to find them
    reads: float  # the records it reads: its end block's at every announcement, every block's at each balance check
    stored_for_others: float  # the stores it receives as one of the key's nearest nodes (the swarm's average)

    @property
    def total(self) -> float:
        return self.announce + self.reads + self.stored_for_others


def per_node(nodes: int, num_blocks: int, mean_span: float) -> Traffic:
    size = record_bytes() + ENTRY_OVERHEAD
    keys = mean_span + 2  # its blocks, the model record, the models list
    hops = math.ceil(math.log2(max(nodes, 2)))  # Kademlia: about log2(N) steps to a key's nearest nodes
    announces = 60 / ANNOUNCE_PERIOD
    announce = announces * keys * (REPLICAS * size + hops * LOOKUP_BYTES)
    records_per_key = nodes * mean_span / num_blocks
    key_read = READ_REPLIES * records_per_key * size + hops * LOOKUP_BYTES
    reads = announces * key_read + 60 / BALANCE_PERIOD * num_blocks * key_read  # probes + balance checks
    stored = announces * keys * REPLICAS * size  # every store lands on some node: on average as many as it sends
    return Traffic(announce, reads, stored)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sim.dht_traffic", description=__doc__)
    parser.add_argument("--spans", type=float, nargs=3, default=[7.8, 5.9, 8.0], help="mean spans at 100/300/1,000")
    args = parser.parse_args()
    print(f"record: {record_bytes()} bytes packed")  # noqa: T201
    print("| nodes | mean span | announce MB/min | reads MB/min | stored for others MB/min | total Mbit/s |")  # noqa: T201
    print("|---|---|---|---|---|---|")  # noqa: T201
    for nodes, span in zip((100, 300, 1000), args.spans, strict=True):
        t = per_node(nodes, 126, span)
        print(  # noqa: T201
            f"| {nodes} | {span:.1f} | {t.announce / 1e6:.2f} | {t.reads / 1e6:.2f} | {t.stored_for_others / 1e6:.2f}"
            f" | {t.total * 8 / 60 / 1e6:.2f} |"
        )


if __name__ == "__main__":
    main()
