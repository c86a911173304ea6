"""What operators see of verification: each node's state and reputation in the swarm report, Prometheus counts,
and whom a tie-breaking replica sides with."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gateway.metrics import swarm_metrics
from gateway.swarm.bans import BanList
from gateway.swarm.report import swarm_report
from gateway.swarm.routing import Hop
from gateway.swarm.verify.compare import Comparison
from gateway.swarm.verify.spot_checks import SpotCheck, _settle, replicas_of, side_of
from gateway.swarm.verify.trust import TrustBook
from gateway.swarm.verify.verifier import Verifier, VerifySettings
from gateway.swarm.view import SwarmView
from shared.identity import new_identity
from shared.membership import CallAuth
from shared.receipts import StepKey, StepStatement, check_receipts, verified_step_key
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
        "evidence": None,  # a challenge is no served step: no receipt
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


def test_a_lost_spot_check_names_the_node_by_the_receipt_of_the_step_checked() -> None:
    verifier = Verifier(None, CallAuth(None, ""), VerifySettings())  # type: ignore[arg-type]  # no calls made
    identity = new_identity()
    key = StepKey(identity.key)
    peer = identity.peer_id
    verifier.book.see(peer, (0, 6))
    verifier.book.passed(peer, "passed its challenge")
    inputs, output = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    step = StepStatement.of("s9", 12, (0, 6), inputs, output)
    public = verified_step_key(key.certificate, peer)
    (receipt,) = check_receipts(public, peer, [step], key.sign([step]))
    check = SpotCheck(Hop(peer, 0, 6), [(12, inputs)], output, receipt=receipt)
    _settle(verifier.book, check, Comparison(0.2, 0.9, False), "another replica's forward", self_check=False)
    view = SwarmView(6, {peer: _record(peer)})
    evidence = swarm_report("m", view, {}, BanList(), verifier=verifier)["nodes"][0]["verification"]["evidence"]
    assert evidence == receipt.evidence()
    assert (evidence["signer"], evidence["session"], evidence["position"]) == (peer, "s9", 12)
    assert evidence["output_sha256"] == step.output_digest.hex()


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
