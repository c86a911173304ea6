"""The swarm monitor routes new sessions on its last view while a newer one is fetched (a request never waits on
the DHT for records that rarely change), and a gap in a stale view is checked against a fresh one."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from hivemind import DHT
from hivemind.p2p import P2P

from gateway.swarm import monitor as view_module
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from shared.dht_records import NodeState, ServerRecord


def record(peer: str, start: int, end: int) -> ServerRecord:
    return ServerRecord(peer_id=peer, start=start, end=end, state=NodeState.ONLINE, version="t", protocol=1)


class FakeDHT:
    """What ``fetch_announcements`` reads: the records announced now; each fetch waits until ``release`` is set."""

    def __init__(self, *records: ServerRecord) -> None:
        self.records = {r.peer_id: r for r in records}
        self.fetches = 0
        self.release = asyncio.Event()
        self.release.set()

    async def fetch(self, dht: Any, model: str, num_blocks: int) -> tuple[dict[str, ServerRecord], dict[str, float]]:
        self.fetches += 1
        await self.release.wait()
        return dict(self.records), {}


@pytest.fixture
def dht(monkeypatch: pytest.MonkeyPatch) -> FakeDHT:
    fake = FakeDHT(record("A", 0, 4))
    monkeypatch.setattr(view_module, "fetch_announcements", fake.fetch)
    return fake


async def test_an_aged_view_is_served_at_once_and_refreshed_behind_it(dht: FakeDHT) -> None:
    monitor = SwarmMonitor(cast(DHT, None), "m", 4, max_age=0.0)  # every view is past its age at once
    first = await monitor.view(stale_ok=30.0)  # nothing held yet: this one waits for the fetch
    assert dht.fetches == 1 and set(first.servers) == {"A"}
    dht.release.clear()  # the DHT is slow now (a fetch crosses continents)
    dht.records["B"] = record("B", 0, 4)
    served = await asyncio.wait_for(monitor.view(stale_ok=30.0), timeout=1)
    assert served is first  # returned without waiting; a refresh is under way
    await asyncio.sleep(0)
    assert dht.fetches == 2
    assert await monitor.view(stale_ok=30.0) is first and dht.fetches == 2  # one refresh at a time
    dht.release.set()
    for _ in range(100):
        newer = await monitor.view(stale_ok=30.0)
        if newer is not first:
            break
        await asyncio.sleep(0.01)
    assert set(newer.servers) == {"A", "B"}
    # Without stale_ok (failovers, probes) an aged view is never served: the caller waits for a new one.
    dht.records.pop("B")
    assert set((await monitor.view()).servers) == {"A"}


async def test_fresh_views_asked_together_share_the_lookups_begun_after_they_asked(dht: FakeDHT) -> None:
    """Every session through a dead node fails over at once, each asking for a fresh view: one lookup begun after
    they asked serves them all, instead of one lookup each, one after another (a DHT read crosses continents)."""
    monitor = SwarmMonitor(cast(DHT, None), "m", 4, max_age=60.0)
    await monitor.view()
    dht.release.clear()
    first = asyncio.create_task(monitor.view(fresh=True))
    await asyncio.sleep(0)  # its lookup has begun: the ones asked from here on are later than it
    assert dht.fetches == 2
    dht.records["B"] = record("B", 0, 4)
    later = [asyncio.create_task(monitor.view(fresh=True)) for _ in range(9)]
    await asyncio.sleep(0)
    dht.release.set()
    views = await asyncio.gather(*later)
    await first
    assert dht.fetches == 3  # the one under way when they asked could not serve them; one more did, for all nine
    assert all(v is views[0] and set(v.servers) == {"A", "B"} for v in views)
    assert (await monitor.view(fresh=True)) is not views[0] and dht.fetches == 4  # asked after it: a lookup of its own


async def test_a_gap_in_a_stale_view_is_checked_against_a_fresh_one_before_routing_fails(dht: FakeDHT) -> None:
    monitor = SwarmMonitor(cast(DHT, None), "m", 4, max_age=60.0)
    router = Router(monitor, cast(P2P, None))
    router.rtts.update({"A": 0.01, "C": 0.01})  # measured: routing probes nobody
    dht.records = {"A": record("A", 0, 2)}
    await monitor.view()  # held (young, within max_age): blocks 2:4 missing
    dht.records["C"] = record("C", 2, 4)  # a node joined since
    assert await router.route(16) == [Hop("A", 0, 2), Hop("C", 2, 4)]  # the gap sent routing to a fresh view
    assert dht.fetches == 2
    assert await router.route(16) == [Hop("A", 0, 2), Hop("C", 2, 4)]  # and that view is held now
    assert dht.fetches == 2


async def test_the_router_counts_its_dht_lookups_and_route_choices(dht: FakeDHT) -> None:
    """What the control plane costs (GET /v1/swarm's counters, bench/swarm24.py): lookups behind the views, background
    refreshes included, and route choices, the one retried on a fresh view included."""
    monitor = SwarmMonitor(cast(DHT, None), "m", 4, max_age=60.0)
    router = Router(monitor, cast(P2P, None))
    monitor.on_lookup = router.stats.record_lookup  # as the engine wires them
    router.rtts.update({"A": 0.01, "C": 0.01})
    dht.records = {"A": record("A", 0, 2)}
    await monitor.view()  # a lookup outside routing (a refresh): counted too
    dht.records["C"] = record("C", 2, 4)
    await router.route(16)  # a gap in the held view: a second choice on a fresh one (a second lookup)
    counters = router.stats.as_dict()
    assert (counters["swarm_lookups"], counters["route_plans"], counters["routes"]) == (2, 2, 1)
    assert counters["swarm_lookup_seconds"] >= 0 and counters["route_seconds"] >= counters["route_plan_seconds"] >= 0
