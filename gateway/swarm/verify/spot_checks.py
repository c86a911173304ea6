"""One spot check of a served step: the hop's whole input so far (its session's history, this step last) is run
as a stateless forward on another replica of the same blocks, and the step's output compared with the forward's
last positions.

    agree                   the node gains reputation
    disagree, a 3rd replica the 3rd decides: whoever it disagrees with is outvoted (loses much reputation)
    disagree, no 3rd        disputed: the checked node loses some (the reference is routed and at least as reputed)
    ... the reference's own   before a dispute counts, the reference runs the same input as a session: when that
    session disowns its     session disowns its forward (or it answers garbage), the reference loses trust as if
    forward                 outvoted and the check ends undecided; the checked node loses nothing
    sole replica            the node re-runs its own step as a prefill: a node whose cache and forwards disagree
                            (drift: a broken kernel, a cache never written) is caught; a node that lies the same way
                            both times is not — a check of a sole replica catches drift, not malice
    garbage                 a forward answered with garbage (a wrong shape, NaN, no valid receipt) loses its node
                            trust as an outvote would; a replica that did is passed over for the next one (none
                            left: the node re-runs its own step)

The check costs one forward of the whole prefix on the checker (``TrustBook.check_probability`` picks steps so
that this stays the configured fraction of the compute served).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import P2P

from gateway.swarm.routing import Hop
from gateway.swarm.verify.compare import Comparison, compare
from gateway.swarm.verify.remote import forward_outputs, session_outputs
from gateway.swarm.verify.tolerances import Precision, Tolerance, tolerance_for
from gateway.swarm.verify.trust import TrustBook
from gateway.swarm.view import SwarmView
from shared.errors import BadReceipt, MalformedReply
from shared.membership import CallAuth
from shared.receipts import Receipt
from shared.server_records import ServerRecord

Versus = Callable[[ServerRecord | None, torch.Tensor], Comparison]  # the checked output against a replica's


@dataclass(frozen=True)
class SpotCheck:
    hop: Hop
    history: list[tuple[int, torch.Tensor]]  # (position, input chunk [1, T, D]) as the session sent them
    output: torch.Tensor  # the last chunk's output [1, T, D]
    adapter: str | None = None  # the LoRA adapter the session ran with: a replica re-runs the step with it too
    receipt: Receipt | None = None  # the node's signed statement of that step: names it when the check fails

    def inputs(self) -> torch.Tensor:
        return torch.cat([chunk for _, chunk in self.history], dim=1)  # [1, P + T, D]

    def evidence(self) -> dict[str, Any] | None:
        return None if self.receipt is None else self.receipt.evidence()


@dataclass(frozen=True)
class SpotResult:
    kind: str  # "spot" (against another replica) or "self" (a sole replica against itself)
    outcome: str  # agreed, outvoted, disputed


def replicas_of(view: SwarmView, book: TrustBook, hop: Hop, adapter: str | None = None) -> list[ServerRecord]:
    """Routed nodes that serve every block of ``hop`` other than its own (with ``adapter``, when the checked session
    named one: the base model's outputs differ by the adapter's update), the most precise and reputed first."""
    covering = [
        s
        for s in view.online()
        if s.peer_id != hop.peer_id
        and s.covers(hop.start, hop.end)
        and book.routable(s.peer_id)
        and (adapter is None or adapter in s.adapters)
    ]
    rank = lambda s: (Precision.parse(s.precision).rank, book.reputation(s.peer_id))  # noqa: E731
    return sorted(covering, key=rank, reverse=True)


async def run_spot_check(
    p2p: P2P, auth: CallAuth, book: TrustBook, view: SwarmView, check: SpotCheck, limit: float
) -> SpotResult:
    hop = check.hop
    blocks = (hop.start, hop.end)
    inputs = check.inputs()
    steps = check.output.shape[1]
    node = view.servers.get(hop.peer_id)
    mine = Precision.parse(node.precision if node else None)
    others = replicas_of(view, book, hop, check.adapter)

    async def on(peer_id: str) -> torch.Tensor | None:
        """The node's forward of the step's input, or None when it answered garbage (a wrong shape, NaN, no valid
        receipt): objectively wrong whatever the step was, so it loses trust as an outvote would. Before, the error
        ended the check unjudged: a sole replica that lied in its sessions dodged every self-check by answering
        forwards with garbage, and a replica doing so went unpunished as a reference."""
        try:
            return (await forward_outputs(p2p, peer_id, blocks, inputs, limit, auth, check.adapter))[:, -steps:]
        except (MalformedReply, BadReceipt) as error:
            reason = f"answered a spot check's forward with garbage: {error}"
            evidence = check.evidence() if peer_id == hop.peer_id else None
            book.lost(peer_id, reason, outvoted=True, self_check=peer_id == hop.peer_id, evidence=evidence)
            return None

    async def next_answer(replicas: Iterator[ServerRecord]) -> tuple[ServerRecord, torch.Tensor] | None:
        """The next replica that answers its forward with a result (silence still ends the check: it raises)."""
        for server in replicas:
            output = await on(server.peer_id)
            if output is not None:
                return server, output
        return None

    def versus(server: ServerRecord | None, want: torch.Tensor) -> Comparison:
        theirs = Precision.parse(server.precision if server else None)
        return compare(inputs[:, -steps:], want, check.output, tolerance_for(mine, theirs))

    replicas = iter(others)
    first = await next_answer(replicas)
    if first is None:  # a sole replica, or no other that answered sense: the node re-runs its own step
        own = await on(hop.peer_id)
        if own is None:
            return SpotResult("self", "outvoted")
        return _settle(book, check, versus(node, own), "its own prefill of the same step", self_check=True)
    reference, want = first
    verdict = versus(reference, want)
    third = None if verdict.agrees else await next_answer(replicas)
    if third is not None:
        return _tie_break(book, check, third[0], reference, (want, third[1]), versus)
    if not verdict.agrees and check.adapter is None and await _disowns(p2p, auth, book, reference, check, want, limit):
        return SpotResult("spot", "undecided")  # the dispute is the reference's doing: the node loses nothing
    return _settle(book, check, verdict, f"{reference.peer_id}'s forward", self_check=False)


async def _disowns(
    p2p: P2P,
    auth: CallAuth,
    book: TrustBook,
    reference: ServerRecord,
    check: SpotCheck,
    want: torch.Tensor,
    limit: float,
) -> bool:
    """Whether ``reference``'s forward (``want``: the step's last positions) is disowned by its own session of the
    same input, held to before a dispute counts against the checked node: a replica lying only in forwards (the
    role a reference plays; its sessions right, so its own checks pass) would otherwise wear down every node checked
    against it. Disowned, or answered with garbage, it loses trust as if outvoted. Raises on silence (the check
    could not run)."""
    inputs, steps, blocks = check.inputs(), check.output.shape[1], (check.hop.start, check.hop.end)
    try:
        session = (await session_outputs(p2p, reference.peer_id, blocks, inputs, limit, auth))[:, -steps:]
    except (MalformedReply, BadReceipt) as error:
        book.lost(reference.peer_id, f"answered a spot check's session with garbage: {error}", outvoted=True)
        return True
    own = compare(inputs[:, -steps:], session, want, tolerance_of(reference, reference))
    if own.agrees:
        return False
    where = f"a spot check of blocks {blocks[0]}:{blocks[1]}"
    book.lost(
        reference.peer_id, f"its forward disagreed with its own session on {where}: {own.describe()}", outvoted=True
    )
    return True


def side_of(with_node: bool, with_reference: bool) -> str:
    """Whom a third replica sides with: "node" (the reference is outvoted), "reference" (the node is), or "none"
    when it cannot tell (it agrees with both: too imprecise to judge a difference the reference saw; or with
    neither): then the checked node is only disputed — the reference was the most precise replica at hand."""
    if with_node != with_reference:
        return "node" if with_node else "reference"
    return "none"


def _tie_break(
    book: TrustBook,
    check: SpotCheck,
    third: ServerRecord,
    reference: ServerRecord,
    outputs: tuple[torch.Tensor, torch.Tensor],
    versus: Versus,
) -> SpotResult:
    """The checked node and ``reference`` disagree: ``third`` decides who is outvoted (``side_of``)."""
    peer, (reference_output, third_output) = check.hop.peer_id, outputs
    with_node = versus(third, third_output)
    with_reference = compare(
        check.inputs()[:, -third_output.shape[1] :], third_output, reference_output, tolerance_of(third, reference)
    )
    side = side_of(with_node.agrees, with_reference.agrees)
    if side == "node":  # the reference is the odd one out
        book.agreed(peer)
        book.lost(reference.peer_id, f"outvoted by {peer} and {third.peer_id} on a spot check", outvoted=True)
        return SpotResult("spot", "agreed")
    blocks = f"{check.hop.start}:{check.hop.end}"
    if side == "reference":
        book.agreed(reference.peer_id)
        reason = f"outvoted on a spot check of blocks {blocks} by {reference.peer_id} and {third.peer_id}"
        book.lost(peer, f"{reason}: {with_node.describe()}", outvoted=True, evidence=check.evidence())
        return SpotResult("spot", "outvoted")
    reason = f"disagreed on a spot check of blocks {blocks} with {reference.peer_id} ({third.peer_id} could not tell)"
    book.lost(peer, reason, outvoted=False, evidence=check.evidence())
    return SpotResult("spot", "disputed")


def tolerance_of(a: ServerRecord, b: ServerRecord) -> Tolerance:
    return tolerance_for(Precision.parse(a.precision), Precision.parse(b.precision))


def _settle(book: TrustBook, check: SpotCheck, verdict: Comparison, against: str, self_check: bool) -> SpotResult:
    kind, peer = "self" if self_check else "spot", check.hop.peer_id
    if verdict.agrees:
        book.agreed(peer, self_check)
        return SpotResult(kind, "agreed")
    reason = f"disagreed on a spot check with {against}: {verdict.describe()}"
    book.lost(peer, reason, outvoted=self_check, self_check=self_check, evidence=check.evidence())
    return SpotResult(kind, "outvoted" if self_check else "disputed")
