"""The gateway's side of receipts: a batch reply's rows resolve with their verified receipts, a reply not signed by
the step key the node certified fails every row with ``BadReceipt``, and that error bans the node and cuts its trust
as a lie does (``gateway.swarm.failover`` → the verifier)."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from gateway.swarm.failover import Failover, FailoverPolicy
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.node_session import NodeSession
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from gateway.swarm.step_links import _answer, _Row
from gateway.swarm.verify.trust import Verification
from gateway.swarm.verify.verifier import Verifier, VerifySettings
from shared.errors import BadReceipt, UnknownSession
from shared.identity import PeerIdentity, new_identity
from shared.membership import CallAuth
from shared.receipts import ReceiptCheck, StepKey, StepStatement, verified_step_key
from shared.wire import BatchStepResult, ErrorReply, encode_response

D = 8


@pytest.fixture(scope="module")
def node() -> tuple[PeerIdentity, StepKey]:
    identity = new_identity()
    return identity, StepKey(identity.key)


def rows_for(node: tuple[PeerIdentity, StepKey], count: int, pushed: bool = False) -> list[_Row]:
    identity, key = node
    public = verified_step_key(key.certificate, identity.peer_id)
    rows = []
    for i in range(count):
        check = ReceiptCheck(identity.peer_id, public, f"session-{i}", (0, 3))
        row = _Row(check, 4 + i, None if pushed else torch.randn(1, 1, D))
        row.future = asyncio.get_running_loop().create_future()
        rows.append(row)
    return rows


def node_reply(
    rows: list[_Row], signer: StepKey, inputs: torch.Tensor, errors: list[ErrorReply | None], pushed: bool
) -> tuple[torch.Tensor, runtime_pb2.ExpertResponse]:
    """What a node answers: its outputs (and, pushed, the inputs it ran on), the rows that ran signed together."""
    outputs = inputs * 2 + 1
    statements = [
        StepStatement.of(row.session_id, row.position, (0, 3), inputs[b : b + 1], outputs[b : b + 1])
        for b, row in enumerate(rows)
        if errors[b] is None
    ]
    reply = BatchStepResult(errors=errors, receipt=signer.sign(statements))
    tensors = (outputs, inputs) if pushed else (outputs,)
    return outputs, encode_response(reply, tensors)


@pytest.mark.parametrize("pushed", [False, True])
async def test_each_row_of_a_batch_reply_comes_with_its_verified_receipt(
    node: tuple[PeerIdentity, StepKey], pushed: bool
) -> None:
    identity, key = node
    rows = rows_for(node, 3, pushed)
    inputs = torch.randn(3, 1, D) if pushed else torch.cat([row.hidden for row in rows if row.hidden is not None])
    errors: list[ErrorReply | None] = [None, ErrorReply.of(UnknownSession("gone")), None]
    outputs, reply = node_reply(rows, key, inputs, errors, pushed)
    _answer(rows, reply, identity.peer_id)
    with pytest.raises(UnknownSession):
        rows[1].future.result()
    for b in (0, 2):
        answer = rows[b].future.result()
        assert torch.equal(answer.output, outputs[b : b + 1]) and torch.equal(answer.input, inputs[b : b + 1])
        receipt = answer.receipt
        assert (receipt.signer, receipt.statement.session_id, receipt.statement.position) == (
            identity.peer_id,
            f"session-{b}",
            4 + b,
        )
        assert receipt.evidence()["rows_signed"] == 2  # the two rows that ran
        receipt.check(rows[b].receipts.key)


async def test_a_reply_signed_by_a_key_the_node_did_not_certify_fails_every_row(
    node: tuple[PeerIdentity, StepKey],
) -> None:
    identity, _ = node
    rows = rows_for(node, 2)
    inputs = torch.cat([row.hidden for row in rows if row.hidden is not None])
    uncertified = StepKey(identity.key)  # what a ``bad-receipt`` node signs with
    _, reply = node_reply(rows, uncertified, inputs, [None, None], pushed=False)
    _answer(rows, reply, identity.peer_id)
    for row in rows:
        with pytest.raises(BadReceipt):
            row.future.result()


async def test_a_reply_of_another_node_fails_where_this_node_was_asked(node: tuple[PeerIdentity, StepKey]) -> None:
    other = new_identity()
    rows = rows_for(node, 1)
    assert rows[0].hidden is not None
    _, reply = node_reply(rows, StepKey(other.key), rows[0].hidden, [None], pushed=False)
    _answer(rows, reply, node[0].peer_id)
    with pytest.raises(BadReceipt):
        rows[0].future.result()


async def test_a_bad_receipt_bans_the_node_and_cuts_its_trust_like_a_lie() -> None:
    verifier = Verifier(cast(P2P, None), CallAuth(None, "gateway"), VerifySettings())
    router = Router(cast(SwarmMonitor, None), cast(P2P, None), verifier=verifier)
    verifier.book.see("liar", (0, 3))
    verifier.book.passed("liar", "passed its challenge")
    assert verifier.routable("liar")

    def never(hop: Hop) -> NodeSession:
        raise AssertionError("learning builds no session")

    failover = Failover(router, FailoverPolicy(), never, lambda: 16, None)
    await failover._learn(Hop("liar", 0, 3), BadReceipt("no valid receipt"), set(), time.monotonic() + 10)
    assert router.bans.banned() == {"liar"}
    node = verifier.book.nodes["liar"]
    assert node.state is Verification.DISTRUSTED and not verifier.routable("liar")
    assert "without a valid receipt" in node.reason
    assert verifier.counts["receipt", "invalid"] == 1
