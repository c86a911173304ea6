"""Routing probes the round trip to nodes it has no estimate for before it routes, and does not wait on a node that
left its probe unanswered again at every route (a dead node's record lingers; a frozen one's stays)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from hivemind import DHT
from hivemind.p2p import P2P

from gateway.swarm import monitor as view_module
from gateway.swarm import router as router_module
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.router import PROBE_RETRY, Router
from gateway.swarm.routing import Hop
from shared.errors import StepTimeout
from tests.unit.gateway.swarm.test_view import FakeDHT, record


class Nodes:
    """``fetch_info`` as the router calls it: ``silent`` nodes never answer (the probe times out)."""

    def __init__(self, silent: set[str]) -> None:
        self.silent = silent
        self.asked: list[str] = []

    async def fetch_info(self, p2p: Any, peer_id: str, wait: float, auth: Any = None) -> tuple[None, float]:
        self.asked.append(peer_id)
        if peer_id in self.silent:
            raise StepTimeout(f"node {peer_id} did not answer info within {wait:g}s")
        return None, 0.01


async def test_a_node_that_left_its_probe_unanswered_is_not_waited_on_at_every_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dht = FakeDHT(record("A", 0, 2), record("B", 2, 4), record("C", 2, 4))
    monkeypatch.setattr(view_module, "fetch_announcements", dht.fetch)
    nodes = Nodes(silent={"C"})
    monkeypatch.setattr(router_module, "fetch_info", nodes.fetch_info)
    clock = [1000.0]
    router = Router(SwarmMonitor(cast(DHT, None), "m", 4, max_age=60.0), cast(P2P, None), clock=lambda: clock[0])

    assert await router.route(16) == [Hop("A", 0, 2), Hop("B", 2, 4)]
    assert sorted(nodes.asked) == ["A", "B", "C"] and "C" not in router.rtts
    for _ in range(3):  # C still announced, still silent: routes go on without probing it again
        await router.route(16)
    assert sorted(nodes.asked) == ["A", "B", "C"]
    clock[0] += PROBE_RETRY + 1  # long enough: a route tries it again
    await router.route(16)
    assert nodes.asked.count("C") == 2
    nodes.silent.clear()
    clock[0] += PROBE_RETRY + 1
    await router.route(16)
    assert router.rtts.get("C") == pytest.approx(0.01)  # it answered: measured, as any node


async def test_the_background_prober_still_tries_a_node_routing_no_longer_waits_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dht = FakeDHT(record("A", 0, 4), record("B", 0, 4))
    monkeypatch.setattr(view_module, "fetch_announcements", dht.fetch)
    nodes = Nodes(silent={"B"})
    monkeypatch.setattr(router_module, "fetch_info", nodes.fetch_info)
    router = Router(SwarmMonitor(cast(DHT, None), "m", 4, max_age=60.0), cast(P2P, None))
    await router.route(16)
    await router.route(16)
    assert nodes.asked.count("B") == 1
    nodes.silent.clear()
    await router._probe_all()  # what the periodic prober runs
    assert nodes.asked.count("B") == 2 and "B" in router.rtts


async def test_a_node_that_never_answered_a_probe_is_routed_only_where_nothing_else_serves_its_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D alone would be the shorter route (one hop where A and B take two); it never answered, so A and B carry the
    session, and D is routed again once it is the only node left for its blocks."""
    dht = FakeDHT(record("A", 0, 2), record("B", 2, 4), record("D", 0, 4))
    monkeypatch.setattr(view_module, "fetch_announcements", dht.fetch)
    nodes = Nodes(silent={"D"})
    monkeypatch.setattr(router_module, "fetch_info", nodes.fetch_info)
    router = Router(SwarmMonitor(cast(DHT, None), "m", 4, max_age=0.0), cast(P2P, None))
    assert await router.route(16) == [Hop("A", 0, 2), Hop("B", 2, 4)]
    dht.records = {"D": record("D", 0, 4)}
    assert await router.route(16, fresh=True) == [Hop("D", 0, 4)]
