"""The DHT traffic model reads what swarm_node reads: one key per next-hop probe, every key per balance check."""

from __future__ import annotations

import pytest

from sim.dht_traffic import ENTRY_OVERHEAD, LOOKUP_BYTES, READ_REPLIES, per_node, record_bytes
from sim.swarm import ANNOUNCE_PERIOD, BALANCE_PERIOD


def test_a_node_reads_its_end_block_per_announcement_and_the_swarm_per_balance_check() -> None:
    nodes, blocks, span = 1000, 126, 8.0
    one_key = READ_REPLIES * nodes * span / blocks * (record_bytes() + ENTRY_OVERHEAD) + 10 * LOOKUP_BYTES  # log2 1000
    probes, checks = 60 / ANNOUNCE_PERIOD, 60 / BALANCE_PERIOD
    assert per_node(nodes, blocks, span).reads == pytest.approx(probes * one_key + checks * blocks * one_key)
