"""Spot checks (``run_spot_check``) where a replica, or the checked node itself, answers the check's forward with
garbage: objectively wrong whatever the step was, so it loses trust, and the check goes on without it."""

from __future__ import annotations

import pytest
import torch

from gateway.swarm.routing import Hop
from gateway.swarm.verify import spot_checks as spot_module
from gateway.swarm.verify.spot_checks import SpotCheck, run_spot_check
from gateway.swarm.verify.trust import TrustBook, Verification
from gateway.swarm.view import SwarmView
from shared.errors import MalformedReply
from shared.membership import CallAuth
from shared.server_records import NodeState, ServerRecord

INPUTS = torch.randn(1, 3, 8)


def _record(peer: str) -> ServerRecord:
    return ServerRecord(
        peer_id=peer, start=0, end=6, state=NodeState.ONLINE, version="t", protocol=6, precision="none/float32/cpu"
    )


def _swarm(peers: tuple[str, ...]) -> tuple[SwarmView, TrustBook]:
    """Every peer verified, the first ones the most reputed (``replicas_of`` asks them first)."""
    book = TrustBook()
    for rank, peer in enumerate(peers):
        book.see(peer, (0, 6))
        book.passed(peer, "passed its challenge")
        book.nodes[peer].reputation -= 0.01 * rank
    return SwarmView(6, {p: _record(p) for p in peers}), book


def _nodes(monkeypatch: pytest.MonkeyPatch, garbage: set[str]) -> list[str]:
    """Forwards as the nodes answer them: the honest model (twice the input), or from those in ``garbage`` a
    malformed result. Returns the peers asked, in order."""
    asked: list[str] = []

    async def forward_outputs(
        p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object
    ) -> torch.Tensor:
        asked.append(peer)
        if peer in garbage:
            raise MalformedReply(f"node {peer} sent a malformed forward result")
        return inputs * 2

    monkeypatch.setattr(spot_module, "forward_outputs", forward_outputs)
    return asked


def _check(peer: str, output: torch.Tensor) -> SpotCheck:
    return SpotCheck(Hop(peer, 0, 6), [(0, INPUTS)], output)


async def test_a_sole_replica_answering_its_self_check_with_garbage_loses_trust(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A liar alone on its blocks answered its session step wrong; re-run as a forward it answers garbage, which
    ended the check unjudged before (every self-check dodged that way)."""
    view, book = _swarm(("liar",))
    _nodes(monkeypatch, garbage={"liar"})
    before = book.reputation("liar")
    result = await run_spot_check(None, CallAuth(None, ""), book, view, _check("liar", -INPUTS), 5.0)  # type: ignore[arg-type]
    assert (result.kind, result.outcome) == ("self", "outvoted")
    assert book.reputation("liar") < before and "garbage" in book.nodes["liar"].reason


async def test_a_replica_answering_garbage_loses_trust_and_the_next_one_checks_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    view, book = _swarm(("junk", "honest", "checked"))
    asked = _nodes(monkeypatch, garbage={"junk"})
    before = book.reputation("junk")
    result = await run_spot_check(None, CallAuth(None, ""), book, view, _check("checked", INPUTS * 2), 5.0)  # type: ignore[arg-type]
    assert (result.kind, result.outcome) == ("spot", "agreed")
    assert asked == ["junk", "honest"]
    assert book.reputation("junk") < before and "garbage" in book.nodes["junk"].reason
    assert book.reputation("checked") > before  # it agreed with the honest replica: no harm from the junk one


async def test_a_replica_answering_garbage_as_the_tie_breaker_gives_way_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checked node lied; the reference disagrees with it; the first third answers garbage, the next one sides
    with the reference: the liar is outvoted (before, the garbage ended the check unjudged)."""
    view, book = _swarm(("reference", "junk", "third", "liar"))
    asked = _nodes(monkeypatch, garbage={"junk"})
    result = await run_spot_check(None, CallAuth(None, ""), book, view, _check("liar", -INPUTS), 5.0)  # type: ignore[arg-type]
    assert (result.kind, result.outcome) == ("spot", "outvoted")
    assert asked == ["reference", "junk", "third"]
    assert "outvoted on a spot check" in book.nodes["liar"].reason
    assert book.nodes["reference"].state is Verification.VERIFIED


async def test_with_every_replica_answering_garbage_the_node_checks_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    view, book = _swarm(("junk", "checked"))
    asked = _nodes(monkeypatch, garbage={"junk"})
    result = await run_spot_check(None, CallAuth(None, ""), book, view, _check("checked", INPUTS * 2), 5.0)  # type: ignore[arg-type]
    assert (result.kind, result.outcome) == ("self", "agreed")
    assert asked == ["junk", "checked"]


@pytest.mark.parametrize("liar", ["reference", "checked"])
async def test_a_dispute_counts_against_the_checked_node_only_once_the_reference_stands_by_its_forward(
    monkeypatch: pytest.MonkeyPatch, liar: str
) -> None:
    """Two replicas disagree and no third can decide. Where the reference lies only in forwards (its sessions
    right, so checks of its own steps pass), its session of the same input disowns its forward: it loses trust and
    the honest node nothing (before, every check against it wore the honest node down). Where the checked node
    lied, the reference's session stands by its forward, and the dispute counts against the node as before."""
    view, book = _swarm(("reference", "checked"))

    async def forward_outputs(p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object) -> object:
        return inputs * 3 if peer == liar else inputs * 2

    async def session_outputs(p2p: object, peer: str, blocks: object, inputs: torch.Tensor, *rest: object) -> object:
        return inputs * 2

    monkeypatch.setattr(spot_module, "forward_outputs", forward_outputs)
    monkeypatch.setattr(spot_module, "session_outputs", session_outputs)
    before = {peer: book.reputation(peer) for peer in ("reference", "checked")}
    served = INPUTS * 2 if liar == "reference" else INPUTS * 3
    result = await run_spot_check(None, CallAuth(None, ""), book, view, _check("checked", served), 5.0)  # type: ignore[arg-type]
    if liar == "reference":
        assert (result.kind, result.outcome) == ("spot", "undecided")
        assert (
            book.reputation("reference") < before["reference"] and "its own session" in book.nodes["reference"].reason
        )
        assert book.reputation("checked") == before["checked"]
    else:
        assert (result.kind, result.outcome) == ("spot", "disputed")
        assert book.reputation("checked") < before["checked"]
        assert book.reputation("reference") == before["reference"]
