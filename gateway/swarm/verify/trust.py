"""What the gateway believes about each node's arithmetic: its verification state and its reputation (pure policy).

    seen ──▶ PROBATION ──challenge passed──▶ VERIFIED ◀──a newcomer agreed with it── UNVERIFIED
                │      ──challenge failed──▶ FAILED                                       ▲
                └──── nothing to compare with (first of its blocks) ──────────────────────┘
    VERIFIED / UNVERIFIED ──reputation < threshold (outvoted by spot checks)──▶ DISTRUSTED

Only VERIFIED and UNVERIFIED nodes are routed, and only while their reputation is at least ``threshold``; the
others carry no user traffic. A node whose announced span changes goes back to PROBATION (what it passed was for
other blocks); its reputation stays. Reputation (0..1) starts at ``START``, moves a little toward 1 with each
check it passes and is cut by a factor for each one it loses; routing prefers reputed nodes (``penalty``) and
checks low-reputation ones more often (``check_probability``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

START = 0.5
AGREED_GAIN = 0.05  # of the distance to 1, per check passed: 10 passes take a new node from 0.5 to 0.7
OUTVOTED_FACTOR = 0.4  # a majority of replicas (or the node's own recomputation) said otherwise
DISPUTED_FACTOR = 0.7  # one reference disagreed and no third replica could break the tie
DEFAULT_THRESHOLD = 0.3  # below it: out of routing (a node at START is out after one outvote, or two disputes)
LOW_REPUTATION = 0.7  # below it a node's steps are checked ``LOW_REPUTATION_BOOST`` times as often
LOW_REPUTATION_BOOST = 4.0
ROUTING_PENALTY = 0.5  # seconds-equivalent added to a hop per unit of reputation missing (routing.py)


class Verification(StrEnum):
    PROBATION = "probation"
    VERIFIED = "verified"
    UNVERIFIED = "unverified"
    FAILED = "failed"
    DISTRUSTED = "distrusted"


@dataclass
class NodeTrust:
    state: Verification
    blocks: tuple[int, int]
    reputation: float = START
    reason: str = ""  # why it is where it is, in words (shown in /v1/swarm and logged)
    checks: dict[str, int] = field(default_factory=dict)  # results of the checks it took part in, by result
    self_checked: bool = False  # its last check was against itself (a sole replica): catches drift, not malice
    evidence: dict[str, Any] | None = None  # the receipt of the step its latest lost check was about (signed by it)
    since: float = 0.0

    @property
    def routable_state(self) -> bool:
        return self.state in (Verification.VERIFIED, Verification.UNVERIFIED)


class TrustBook:
    def __init__(self, threshold: float = DEFAULT_THRESHOLD, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self._clock = clock
        self.nodes: dict[str, NodeTrust] = {}

    def see(self, peer_id: str, blocks: tuple[int, int]) -> bool:
        """Note a node's announced span; True when it is new (or moved) and now waits for its challenge."""
        known = self.nodes.get(peer_id)
        if known is not None and known.blocks == blocks:
            return False
        if known is not None and known.state in (Verification.FAILED, Verification.DISTRUSTED):
            known.blocks = blocks  # moving does not wash a verdict away
            return False
        reputation = START if known is None else known.reputation
        self.nodes[peer_id] = NodeTrust(Verification.PROBATION, blocks, reputation, "waiting for its challenge")
        self.nodes[peer_id].since = self._clock()
        return True

    def routable(self, peer_id: str) -> bool:
        node = self.nodes.get(peer_id)
        return node is not None and node.routable_state and node.reputation >= self.threshold

    def excluded(self, peer_ids: Iterable[str]) -> frozenset[str]:
        """The nodes among ``peer_ids`` that must carry no user traffic."""
        return frozenset(peer for peer in peer_ids if not self.routable(peer))

    def passed(self, peer_id: str, reason: str) -> None:
        self._set(peer_id, Verification.VERIFIED, reason)

    def unverified(self, peer_id: str, reason: str) -> None:
        self._set(peer_id, Verification.UNVERIFIED, reason)

    def failed(self, peer_id: str, reason: str) -> None:
        self._set(peer_id, Verification.FAILED, reason)

    def confirmed(self, peer_id: str) -> None:
        """An UNVERIFIED node that a newcomer's challenge agreed with is verified: two replicas computed the same."""
        node = self.nodes.get(peer_id)
        if node is not None and node.state is Verification.UNVERIFIED:
            self._set(peer_id, Verification.VERIFIED, "a newer replica's challenge agreed with it")

    def agreed(self, peer_id: str, self_check: bool = False) -> None:
        """A check it passed; one against itself (a sole replica) earns nothing: a consistent liar passes those."""
        node = self.nodes.get(peer_id)
        if node is not None:
            node.reputation += 0.0 if self_check else (1.0 - node.reputation) * AGREED_GAIN
            node.self_checked = self_check
            self._count(node, "agreed")

    def lost(
        self,
        peer_id: str,
        reason: str,
        outvoted: bool,
        self_check: bool = False,
        evidence: dict[str, Any] | None = None,
    ) -> bool:
        """A check this node lost: by a majority (``outvoted``) or a dispute with no tie-break; ``evidence``: the
        node's receipt of the step checked (``shared.receipts``). True when that took it out of routing."""
        node = self.nodes.get(peer_id)
        if node is None:
            return False
        was_routable = self.routable(peer_id)
        node.reputation *= OUTVOTED_FACTOR if outvoted else DISPUTED_FACTOR
        node.self_checked = self_check
        node.reason = reason
        if evidence is not None:
            node.evidence = evidence
        self._count(node, "outvoted" if outvoted else "disputed")
        if was_routable and node.reputation < self.threshold:
            self._set(peer_id, Verification.DISTRUSTED, reason)
            return True
        return False

    def reputation(self, peer_id: str) -> float:
        node = self.nodes.get(peer_id)
        return START if node is None else node.reputation

    def penalty(self, peer_id: str) -> float:
        """Seconds-equivalent routing adds to a hop on this node: less reputation, less traffic."""
        return ROUTING_PENALTY * (1.0 - self.reputation(peer_id))

    def check_probability(self, peer_id: str, step_tokens: int, check_tokens: int, rate: float) -> float:
        """The chance a step of ``step_tokens`` is re-run as a forward of ``check_tokens`` (its whole prefix):
        ``rate`` is the extra compute spent on checks, as a fraction of the compute served, so a step is picked in
        proportion to what it served over what its check costs; low-reputation nodes ``LOW_REPUTATION_BOOST`` x."""
        boost = LOW_REPUTATION_BOOST if self.reputation(peer_id) < LOW_REPUTATION else 1.0
        return min(1.0, rate * boost * step_tokens / max(1, check_tokens))

    def _set(self, peer_id: str, state: Verification, reason: str) -> None:
        node = self.nodes.get(peer_id)
        if node is None:
            return
        node.state, node.reason, node.since = state, reason, self._clock()

    @staticmethod
    def _count(node: NodeTrust, result: str) -> None:
        node.checks[result] = node.checks.get(result, 0) + 1
