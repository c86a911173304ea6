"""A server record is a stranger's word: numbers that would break or bias route search are refused on read."""

from __future__ import annotations

import math
from typing import Any

import pytest

from shared.server_records import parse_server_entries


def _record(peer: str = "QmNode", **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "peer_id": peer,
        "start": 0,
        "end": 2,
        "state": "online",
        "throughput": 10.0,
        "next_rtts": {"QmNext": 0.02},
        "version": "0",
        "protocol": 6,
    }
    record.update(fields)
    return record


def test_an_honest_record_is_kept() -> None:
    servers = parse_server_entries([{"QmNode": _record()}])
    assert servers["QmNode"].next_rtts == {"QmNext": 0.02}


@pytest.mark.parametrize(
    "fields",
    [
        {"throughput": math.inf},
        {"throughput": math.nan},
        {"prefill_throughput": math.inf},
        {"next_rtts": {"QmNext": math.nan}},
        {"next_rtts": {"QmNext": -0.5}},
        {"next_rtts": {"QmNext": math.inf}},
        {"next_rtts": {f"Qm{i}": 0.01 for i in range(65)}},
    ],
    ids=["inf-throughput", "nan-throughput", "inf-prefill", "nan-rtt", "negative-rtt", "inf-rtt", "too-many-rtts"],
)
def test_a_record_with_numbers_route_search_cannot_trust_is_dropped(fields: dict[str, Any]) -> None:
    assert parse_server_entries([{"QmNode": _record(**fields)}]) == {}
