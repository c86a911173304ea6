"""Probation challenges (``Verifier._challenge``) against references whose trust changes while they run."""

from __future__ import annotations

import pytest
import torch

from gateway.swarm.verify import verifier as verifier_module
from gateway.swarm.verify.trust import Verification
from gateway.swarm.verify.verifier import Verifier, VerifySettings
from gateway.swarm.view import SwarmView
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
