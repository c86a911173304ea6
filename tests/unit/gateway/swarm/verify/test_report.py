"""What operators see of verification: each node's state and reputation in the swarm report, Prometheus counts,
and whom a tie-breaking replica sides with."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gateway.metrics import swarm_metrics
from gateway.swarm.bans import BanList
from gateway.swarm.report import swarm_report
from gateway.swarm.routing import Hop
from gateway.swarm.verify.spot_checks import replicas_of, side_of
from gateway.swarm.verify.trust import TrustBook
from gateway.swarm.verify.verifier import Verifier, VerifySettings
from gateway.swarm.view import SwarmView
from shared.membership import CallAuth
from shared.server_records import NodeState, ServerRecord


def _record(peer: str) -> ServerRecord:
    return ServerRecord(
        peer_id=peer, start=0, end=6, state=NodeState.ONLINE, version="t", protocol=5, precision="none/float32/cpu"
    )


class _Report(Collector):
    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report

    def collect(self) -> Iterable[Metric]:
        return list(swarm_metrics(self.report))


def test_the_report_and_metrics_show_each_nodes_verification() -> None:
    verifier = Verifier(None, CallAuth(None, ""), VerifySettings())  # type: ignore[arg-type]  # no calls made
    view = SwarmView(6, {p: _record(p) for p in ("good", "liar", "sole")})
    for peer in ("good", "liar", "sole"):
        verifier.book.see(peer, (0, 6))
    verifier.book.passed("good", "passed its challenge")
    verifier.book.failed("liar", "failed its challenge: cosine 0.1")
    verifier.book.unverified("sole", "first node of its blocks")
    verifier.book.agreed("sole", self_check=True)
    verifier.counts["challenge", "failed"] += 1
    report = swarm_report("m", view, {}, BanList(), verifier=verifier)
    nodes = {n["peer_id"]: n["verification"] for n in report["nodes"]}
    assert nodes["good"]["state"] == "verified" and nodes["good"]["routed"]
    assert nodes["liar"] == {
        "state": "failed",
        "routed": False,
        "reputation": 0.5,
        "reason": "failed its challenge: cosine 0.1",
        "checks": {},
    }
    assert "catches drift, not malice" in nodes["sole"]["reason"] and nodes["sole"]["checks"] == {"agreed": 1}
    registry = CollectorRegistry()
    registry.register(_Report(report))
    text = generate_latest(registry).decode()
    assert 'swarmgate_verification_checks_total{kind="challenge",result="failed"} 1.0' in text
    assert 'swarmgate_verification_node_checks_total{node="sole",result="agreed"} 1.0' in text
    assert 'swarmgate_node_reputation{node="liar"} 0.5' in text


def test_a_third_replica_decides_only_when_it_can_tell() -> None:
    assert side_of(with_node=False, with_reference=True) == "reference"  # the node is outvoted
    assert side_of(with_node=True, with_reference=False) == "node"  # the reference is
    assert side_of(with_node=True, with_reference=True) == "none"  # too imprecise to tell: only a dispute
    assert side_of(with_node=False, with_reference=False) == "none"


def test_a_step_under_an_adapter_is_checked_only_on_replicas_that_serve_that_adapter() -> None:
    base, with_one = _record("base"), _record("with-one").model_copy(update={"adapters": ["one"]})
    view = SwarmView(6, {s.peer_id: s for s in (_record("checked"), base, with_one)})
    book = TrustBook()
    for peer in view.servers:
        book.see(peer, (0, 6))
        book.passed(peer, "passed its challenge")
    hop = Hop("checked", 0, 6)
    assert {s.peer_id for s in replicas_of(view, book, hop)} == {"base", "with-one"}
    assert [s.peer_id for s in replicas_of(view, book, hop, "one")] == ["with-one"]  # the base model would disagree
    assert replicas_of(view, book, hop, "two") == []  # none: the node re-runs the step itself, with its adapter
