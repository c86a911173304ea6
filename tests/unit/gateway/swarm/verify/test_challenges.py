"""Probation challenges (``Verifier._challenge``) against references whose trust changes while they run."""

from __future__ import annotations

import pytest
import torch

from gateway.swarm.verify import verifier as verifier_module
from gateway.swarm.verify.trust import Verification
from gateway.swarm.verify.verifier import Verifier, VerifySettings
from gateway.swarm.view import SwarmView
from shared.errors import MalformedReply, StepTimeout, SwarmError
from shared.membership import CallAuth
from shared.server_records import NodeState, ServerRecord


def _record(peer: str) -> ServerRecord:
    return ServerRecord(
        peer_id=peer, start=0, end=6, state=NodeState.ONLINE, version="t", protocol=6, precision="none/float32/cpu"
    )


async def test_a_challenge_against_a_reference_outvoted_meanwhile_runs_again_instead_of_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two honest nodes join next to an unverified liar: the second one's challenge outvotes the liar while the
    first one's, against that same liar, is still running. Its disagreement with a node now out of routing says
    nothing about it: it stays in probation and is challenged again (it was failed for good, an honest node flagged,
    in a CI run)."""
    verifier = Verifier(None, CallAuth(None, ""), VerifySettings(hidden_size=8))  # type: ignore[arg-type]
    view = SwarmView(6, {p: _record(p) for p in ("liar", "honest")})
    verifier._view = view
    verifier.book.see("liar", (0, 6))
    verifier.book.unverified("liar", "first node of its blocks")
    verifier.book.see("honest", (0, 6))

    async def session_outputs(
        p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        return inputs * 2  # the honest model

    async def forward_outputs(
        p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        assert peer == "liar"
        verifier.book.lost("liar", "outvoted at another node's challenge", outvoted=True)  # the other challenge won
        return inputs  # lazy: its input back

    monkeypatch.setattr(verifier_module, "session_outputs", session_outputs)
    monkeypatch.setattr(verifier_module, "forward_outputs", forward_outputs)
    await verifier._challenge("honest")
    node = verifier.book.nodes["honest"]
    assert node.state is Verification.PROBATION, node.reason
    assert "lost its trust during the challenge" in node.reason and "honest" in verifier._retry
    assert verifier.counts["challenge", "failed"] == 0


def _verifier_with(references: dict[str, str]) -> Verifier:
    """A verifier that has seen ``candidate`` and each reference in its state ("verified" or "unverified"); the
    verified ones are asked first."""
    verifier = Verifier(None, CallAuth(None, ""), VerifySettings(hidden_size=8))  # type: ignore[arg-type]
    verifier._view = SwarmView(6, {p: _record(p) for p in ("candidate", *references)})
    for peer, state in references.items():
        verifier.book.see(peer, (0, 6))
        if state == "verified":
            verifier.book.passed(peer, "passed its challenge")
        else:
            verifier.book.unverified(peer, "first node of its blocks")
    verifier.book.see("candidate", (0, 6))
    return verifier


def _honest_but(
    monkeypatch: pytest.MonkeyPatch, broken: dict[str, SwarmError], forward_liar: str | None = None
) -> list[str]:
    """Every node computes the honest model (twice its input) except those in ``broken``, whose forward raises
    their error, and ``forward_liar``'s stateless forwards (three times its input); returns the peers asked for a
    forward, in order."""
    asked: list[str] = []

    async def session_outputs(
        p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        return inputs * 2

    async def forward_outputs(
        p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        asked.append(peer)
        if peer in broken:
            raise broken[peer]
        return inputs * 3 if peer == forward_liar else inputs * 2

    monkeypatch.setattr(verifier_module, "session_outputs", session_outputs)
    monkeypatch.setattr(verifier_module, "forward_outputs", forward_outputs)
    return asked


async def test_a_reference_that_does_not_answer_gives_way_to_the_next_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The best reference is frozen (its p2pd accepts the call, nothing answers): the newcomer is compared with the
    next one instead of waiting in probation for the frozen node's record to expire."""
    verifier = _verifier_with({"frozen": "verified", "good": "unverified"})
    asked = _honest_but(monkeypatch, {"frozen": StepTimeout("node frozen did not answer a check's forward within 5s")})
    await verifier._challenge("candidate")
    node = verifier.book.nodes["candidate"]
    assert node.state is Verification.VERIFIED and "against good" in node.reason, node.reason
    assert asked[:2] == ["frozen", "good"]


@pytest.mark.parametrize("others", [("liar", "honest"), ("liar",)])
async def test_a_reference_answering_garbage_never_fails_the_newcomer(
    monkeypatch: pytest.MonkeyPatch, others: tuple[str, ...]
) -> None:
    """A reference whose forward is malformed (a wrong shape) says nothing about the node challenged against it:
    the next reference decides; with none left the challenge could not run and is tried again later. The garbage
    cuts the reference's own trust. (A lying first node used to get every honest newcomer of its blocks failed for
    good this way.)"""
    verifier = _verifier_with({peer: "verified" if peer == "liar" else "unverified" for peer in others})
    _honest_but(monkeypatch, {"liar": MalformedReply("node liar sent a malformed forward result")})
    await verifier._challenge_guarded("candidate")
    node = verifier.book.nodes["candidate"]
    if "honest" in others:
        assert node.state is Verification.VERIFIED and "against honest" in node.reason, node.reason
    else:
        assert node.state is Verification.PROBATION and "could not run" in node.reason, node.reason
        assert "candidate" in verifier._retry
    assert verifier.counts["challenge", "failed"] == 0
    assert verifier.book.reputation("liar") < 0.5  # garbage is evidence against the reference itself


async def test_a_newcomer_answering_the_challenge_back_with_garbage_loses_trust_not_the_first_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The newcomer passes its challenge against the unverified first node (its session agrees with the first
    node's forward), and is then asked a forward to check the first node's session against: it answers garbage.
    That is evidence against the newcomer, not the first node (the honest first node was outvoted for it: a liar
    joining could take the only honest node of its blocks out of routing)."""
    verifier = _verifier_with({"first": "unverified"})
    _honest_but(monkeypatch, {"candidate": MalformedReply("node candidate sent a malformed forward result")})
    await verifier._challenge_guarded("candidate")
    first, candidate = verifier.book.nodes["first"], verifier.book.nodes["candidate"]
    assert first.state is Verification.UNVERIFIED and verifier.book.reputation("first") == 0.5, first.reason
    assert candidate.state is Verification.DISTRUSTED and "garbage" in candidate.reason, candidate.reason


async def test_a_third_answering_a_tie_break_with_garbage_loses_trust_and_the_newcomer_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The newcomer disagrees with the unverified first node (a consistent liar: the same wrong answer in sessions
    and forwards); the third node asked to break the tie answers garbage: the newcomer stays undecided, and the garbage
    counts against the third."""
    verifier = _verifier_with({"first": "unverified"})
    verifier._view = SwarmView(6, {p: _record(p) for p in ("candidate", "first", "third")})
    verifier.book.see("third", (0, 6))  # in probation: not a reference, but a third may be
    _honest_but(monkeypatch, {"third": MalformedReply("node third sent a malformed forward result")})
    real_forward = verifier_module.forward_outputs

    async def forward_outputs(p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object) -> object:
        return inputs * 3 if peer == "first" else await real_forward(p2p, peer, blocks, inputs, *rest)

    real_session = verifier_module.session_outputs

    async def session_outputs(p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object) -> object:
        return inputs * 3 if peer == "first" else await real_session(p2p, peer, blocks, inputs, *rest)

    monkeypatch.setattr(verifier_module, "forward_outputs", forward_outputs)
    monkeypatch.setattr(verifier_module, "session_outputs", session_outputs)
    await verifier._challenge_guarded("candidate")
    assert verifier.book.nodes["candidate"].state is Verification.PROBATION
    assert verifier.book.reputation("third") < 0.5 and "garbage" in verifier.book.nodes["third"].reason
    assert verifier.book.reputation("first") == 0.5


@pytest.mark.parametrize("state", ["verified", "unverified"])
async def test_a_reference_whose_forward_disagrees_with_its_own_session_loses_trust_not_the_newcomer(
    monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    """The reference lies only in forwards: the newcomer disagrees with it, and the reference's own session of the
    same input disagrees with its forward too. Before, a verified such reference failed every honest newcomer for
    good, an unverified one kept them waiting for a third node."""
    verifier = _verifier_with({"liar": state})
    _honest_but(monkeypatch, {}, forward_liar="liar")
    await verifier._challenge_guarded("candidate")
    candidate, liar = verifier.book.nodes["candidate"], verifier.book.nodes["liar"]
    assert candidate.state is Verification.PROBATION and "cannot stand by" in candidate.reason, candidate.reason
    assert "candidate" in verifier._retry
    assert verifier.book.reputation("liar") < 0.5 and "its own session" in liar.reason, liar.reason


async def test_a_newcomer_whose_forward_disagrees_with_its_own_session_cannot_outvote_the_first_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The newcomer lies only in forwards: its session passes against the first node's forward, and its forward,
    asked to check the first node's session, disagrees with it — and with its own session. Before, that outvoted
    the honest first node."""
    verifier = _verifier_with({"first": "unverified"})
    _honest_but(monkeypatch, {}, forward_liar="candidate")
    await verifier._challenge_guarded("candidate")
    first, candidate = verifier.book.nodes["first"], verifier.book.nodes["candidate"]
    assert first.state is Verification.UNVERIFIED and verifier.book.reputation("first") == 0.5, first.reason
    assert candidate.state is Verification.DISTRUSTED and "its own session" in candidate.reason, candidate.reason
