"""The gateway's verifier: puts every new node through probation and spot-checks served steps, off the token path.

It owns a ``TrustBook``; the router asks it which nodes are excluded from routing and how reputed the others are.
Whether a new node needs a challenge is decided as the view is read, in a stable order (so of several nodes that
appear together for the same blocks, the first becomes the ``unverified`` reference and the others are challenged
against it); challenges then run as background tasks, ``CHALLENGES_AT_ONCE`` at a time, each within
``CHALLENGE_TIMEOUT`` (a frozen node holds up no other's). Spot checks run as background tasks, at most
``max_checks`` at once (a step sampled while they are all busy is not checked, and counted as skipped). Nothing here
is awaited by a user's step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P

from gateway.swarm.routing import Hop
from gateway.swarm.verify.compare import Comparison
from gateway.swarm.verify.probation import CHALLENGE_TOKENS, Challenge, judge, new_challenge, overlap, reference_order
from gateway.swarm.verify.remote import forward_outputs, session_outputs
from gateway.swarm.verify.spot_checks import SpotCheck, run_spot_check
from gateway.swarm.verify.trust import NodeTrust, TrustBook, Verification
from gateway.swarm.view import SwarmView
from shared.errors import BadReceipt, MalformedReply, SwarmError
from shared.membership import CallAuth
from shared.receipts import Receipt
from shared.server_records import ServerRecord

logger = logging.getLogger(__name__)

_NEW = NodeTrust(Verification.PROBATION, (0, 0))  # how a node the book has not seen yet counts
CHALLENGE_RETRY = 5.0  # seconds before a challenge that could not run (node busy, unreachable) is tried again
CHALLENGE_TIMEOUT = 10.0  # seconds a challenge's remote calls may take (8 tokens: far less than a step's timeout)
CHALLENGES_AT_ONCE = 4
# Seconds a challenge waits on one reference's forward before it asks the next (8 tokens through a span: well under a
# second on a GPU; a CPU under load takes a few): a frozen reference must not hold a newcomer in probation alone.
REFERENCE_TIMEOUT = CHALLENGE_TIMEOUT / 2


@dataclass(frozen=True)
class VerifySettings:
    enabled: bool = True
    check_rate: float = 0.02  # extra compute spent on spot checks, as a fraction of the compute served
    threshold: float = 0.3  # reputation below which a node is out of routing
    max_checks: int = 2  # spot checks running at once
    timeout: float = 30.0  # seconds a check's remote call may take
    hidden_size: int = 0
    dtype: torch.dtype = torch.float32


class NoReferenceAnswered(SwarmError):
    """Every reference a challenge could run against failed to answer its forward: the challenge could not run."""


class Verifier:
    def __init__(self, p2p: P2P, auth: CallAuth, settings: VerifySettings) -> None:
        self._p2p = p2p
        self._auth = auth
        self.settings = settings
        self.book = TrustBook(settings.threshold)
        self.counts: Counter[tuple[str, str]] = Counter()  # (kind, result) -> checks
        self._challenges: set[asyncio.Task[None]] = set()
        self._challenge_slots = asyncio.Semaphore(CHALLENGES_AT_ONCE)
        self._retry: dict[str, float] = {}
        self._view: SwarmView | None = None
        self._checks: set[asyncio.Task[None]] = set()
        self._random = random.Random()
        self._announced_out: set[str] = set()  # distrusted nodes already logged

    def start(self) -> None:
        """Nothing runs until the first view is watched (challenges and checks are started as they are due)."""

    async def close(self) -> None:
        tasks = [*self._challenges, *self._checks]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- what routing asks ---------------------------------------------------------------------------------------

    def watch(self, view: SwarmView) -> None:
        """Note the view's nodes; new ones are queued for their challenge (or, first of their blocks, unverified)."""
        self._view = view
        if not self.settings.enabled:
            return
        loop_time = asyncio.get_running_loop().time()
        for server in sorted(view.online(), key=lambda s: (s.start, s.peer_id)):  # a stable order: see the docstring
            if self.book.see(server.peer_id, (server.start, server.end)):
                self._queue_or_settle(view, server)
            elif self._retry.get(server.peer_id, float("inf")) <= loop_time:
                del self._retry[server.peer_id]
                self._start_challenge(server.peer_id)

    def excluded(self, view: SwarmView) -> frozenset[str]:
        if not self.settings.enabled:
            return frozenset()
        return self.book.excluded(s.peer_id for s in view.online())

    def routable(self, peer_id: str) -> bool:
        return not self.settings.enabled or self.book.routable(peer_id)

    def penalties(self, view: SwarmView) -> dict[str, float]:
        return {s.peer_id: self.book.penalty(s.peer_id) for s in view.online()} if self.settings.enabled else {}

    # -- probation -----------------------------------------------------------------------------------------------

    def _queue_or_settle(self, view: SwarmView, server: ServerRecord) -> None:
        if self._references(view, server):
            self._start_challenge(server.peer_id)
            return
        reason = "first node of its blocks: nothing to compare it with yet"
        self.book.unverified(server.peer_id, reason)
        logger.info("node %s (blocks %d:%d) is unverified: %s", server.peer_id, server.start, server.end, reason)

    def _references(self, view: SwarmView, candidate: ServerRecord) -> list[ServerRecord]:
        """Routed replicas sharing blocks with ``candidate``, the best reference first."""
        usable = [
            s
            for s in view.online()
            if s.peer_id != candidate.peer_id and self.book.routable(s.peer_id) and overlap(candidate, s)
        ]
        verified = [s for s in usable if self.book.nodes[s.peer_id].state is Verification.VERIFIED]
        return sorted(
            usable,
            key=lambda s: (s in verified, *reference_order(candidate, s, self.book.reputation(s.peer_id))),
            reverse=True,
        )

    def _start_challenge(self, peer_id: str) -> None:
        task = asyncio.create_task(self._challenge_guarded(peer_id))
        self._challenges.add(task)
        task.add_done_callback(self._challenges.discard)

    async def _challenge_guarded(self, peer_id: str) -> None:
        async with self._challenge_slots:
            try:
                async with asyncio.timeout(CHALLENGE_TIMEOUT):
                    await self._challenge(peer_id)
            except (MalformedReply, BadReceipt) as error:  # garbage (NaN, a wrong shape or dtype) or unsigned
                self._fail(peer_id, f"answered its challenge with garbage: {error}")
            except Exception as error:  # could not be challenged now (busy, gone, timed out): stays in probation
                self.counts["challenge", "error"] += 1
                why = f"no answer within {CHALLENGE_TIMEOUT:g}s" if isinstance(error, TimeoutError) else str(error)
                node = self.book.nodes.get(peer_id)
                if node is not None and node.state is Verification.PROBATION:
                    node.reason = f"its challenge could not run ({why}); trying again"
                    self._retry[peer_id] = asyncio.get_running_loop().time() + CHALLENGE_RETRY
                logger.info("challenge of node %s could not run: %s", peer_id, why)

    async def _challenge(self, peer_id: str) -> None:
        view = self._view
        node = self.book.nodes.get(peer_id)
        if view is None or node is None or node.state is not Verification.PROBATION or peer_id not in view.servers:
            return
        candidate = view.servers[peer_id]
        references = self._references(view, candidate)
        if not references:
            self._queue_or_settle(view, candidate)
            return
        blocks = overlap(candidate, references[0])
        assert blocks is not None  # references share blocks by construction
        challenge = new_challenge(blocks, self.settings.hidden_size, self.settings.dtype, CHALLENGE_TOKENS)
        timeout = self.settings.timeout
        got, (reference, want, unverified) = await asyncio.gather(
            session_outputs(self._p2p, peer_id, blocks, challenge.inputs, timeout, self._auth),
            self._reference_forward(references, challenge),
        )
        verdict = judge(challenge, candidate, reference, got, want)
        where = f"blocks {blocks[0]}:{blocks[1]} against {reference.peer_id} (seed {challenge.seed})"
        if not verdict.agrees and not self.book.routable(reference.peer_id):
            # Another challenge outvoted the reference while this one ran: disagreeing with it says nothing.
            self._undecided(peer_id, f"its reference {reference.peer_id} lost its trust during the challenge", 0.0)
            return
        if not verdict.agrees and await self._forward_disowned(reference, challenge, want):
            self._undecided(peer_id, f"its reference {reference.peer_id} answered a forward it cannot stand by", 0.0)
            return
        if not verdict.agrees and unverified:
            decided = await self._tie_break(view, candidate, reference, challenge, got)
            if decided is None:  # one against one, and nobody to ask: wait for a third node
                self._undecided(peer_id, f"disagrees with unverified {reference.peer_id} ({verdict.describe()})")
                return
            verdict, where = decided
        if verdict.agrees:
            self.book.passed(peer_id, f"passed its challenge on {where}: {verdict.describe()}")
            if self.book.nodes[reference.peer_id].state is Verification.UNVERIFIED:
                await self._challenge_back(candidate, reference, challenge, got)
            self.counts["challenge", "passed"] += 1
            logger.info("node %s passed its challenge on %s: %s", peer_id, where, verdict.describe())
            return
        self._fail(peer_id, f"failed its challenge on {where}: {verdict.describe()}")

    async def _reference_forward(
        self, references: list[ServerRecord], challenge: Challenge
    ) -> tuple[ServerRecord, torch.Tensor, bool]:
        """The challenge's forward on the first reference over its blocks that answers it: (that reference, its
        output, whether it was unverified before the call). A reference that does not answer within
        ``REFERENCE_TIMEOUT`` (frozen, unreachable from here) or answers garbage says nothing about the candidate:
        the next one is asked (garbage, objectively wrong, cuts the reference's own trust). Raises
        ``NoReferenceAnswered`` (the challenge could not run) when none did."""
        start, end = challenge.blocks
        limit = min(self.settings.timeout, REFERENCE_TIMEOUT)
        failures = []
        for reference in [r for r in references if r.covers(start, end)]:
            unverified = self.book.nodes[reference.peer_id].state is Verification.UNVERIFIED  # before the call
            try:
                want = await forward_outputs(
                    self._p2p, reference.peer_id, challenge.blocks, challenge.inputs, limit, self._auth
                )
            except (MalformedReply, BadReceipt) as error:  # garbage, or unsigned: cut its trust as an outvote would
                failures.append(f"{reference.peer_id}: {error}")
                self._outvoted(reference.peer_id, f"answered a challenge's forward with garbage: {error}")
                continue
            except (SwarmError, TimeoutError) as error:
                failures.append(f"{reference.peer_id}: {error}")
                logger.info("reference %s did not answer a challenge's forward: %s", reference.peer_id, error)
                continue
            return reference, want, unverified
        raise NoReferenceAnswered("no reference answered its forward (" + "; ".join(failures) + ")")

    async def _forward_disowned(self, server: ServerRecord, challenge: Challenge, forward: torch.Tensor) -> bool:
        """Whether ``server``'s ``forward`` of the challenge disagrees with its own session on the same input (run
        now): then the disagreement is its own doing — a node that lies only in forwards, the role a reference and
        a checker play, while its sessions are right — and it loses trust as if outvoted. Before, such a first node
        kept every honest newcomer of its blocks waiting for a third node, and a verified one failed them.
        False where the session does not come (silence says nothing)."""
        timeout, blocks, inputs = self.settings.timeout, challenge.blocks, challenge.inputs
        try:
            session = await session_outputs(self._p2p, server.peer_id, blocks, inputs, timeout, self._auth)
        except (MalformedReply, BadReceipt) as error:
            self._outvoted(server.peer_id, f"answered a session with garbage: {error}")
            return True
        except (SwarmError, TimeoutError) as error:
            logger.info("node %s did not answer a session to check its forward against: %s", server.peer_id, error)
            return False
        return self._disowns(server, challenge, session, forward)

    def _disowns(
        self, server: ServerRecord, challenge: Challenge, session: torch.Tensor, forward: torch.Tensor
    ) -> bool:
        """Whether ``server``'s forward and session of the challenge's input disagree (then it loses trust)."""
        verdict = judge(challenge, server, server, session, forward)
        if verdict.agrees:
            return False
        seed = challenge.seed
        self._outvoted(
            server.peer_id, f"its forward disagreed with its own session (seed {seed}): {verdict.describe()}"
        )
        return True

    def _outvoted(self, peer_id: str, reason: str) -> None:
        self.counts["challenge", "outvoted"] += 1
        if self.book.lost(peer_id, reason, outvoted=True):
            logger.warning("node %s is out of routing: %s", peer_id, reason)

    async def _challenge_back(
        self, candidate: ServerRecord, reference: ServerRecord, challenge: Challenge, candidate_session: torch.Tensor
    ) -> None:
        """An unverified reference answered the challenge's forward; its sessions (where a cache is used) are
        checked too, against the candidate's forward, before it counts as verified. A candidate whose forward
        disagrees with its own session of the challenge (``candidate_session``) is the one found out."""
        timeout, blocks, inputs = self.settings.timeout, challenge.blocks, challenge.inputs
        got, want = await asyncio.gather(
            session_outputs(self._p2p, reference.peer_id, blocks, inputs, timeout, self._auth),
            forward_outputs(self._p2p, candidate.peer_id, blocks, inputs, timeout, self._auth),
            return_exceptions=True,
        )
        # Garbage (or an unsigned reply) is evidence against whoever sent it: the candidate's forward garbage once
        # outvoted the reference, so a liar joining could take an honest first node out of routing.
        if isinstance(want, MalformedReply | BadReceipt):
            self._outvoted(candidate.peer_id, f"answered a challenge's forward with garbage: {want}")
        if isinstance(got, MalformedReply | BadReceipt):
            self._outvoted(reference.peer_id, f"answered a session with garbage: {got}")
        for result in (got, want):
            if isinstance(result, BaseException) and not isinstance(result, MalformedReply | BadReceipt):
                raise result  # silence, a refusal: the challenge could not run
        if isinstance(got, BaseException) or isinstance(want, BaseException):
            return
        verdict = judge(challenge, reference, candidate, got, want)
        if verdict.agrees:
            self.book.confirmed(reference.peer_id)
        elif not self._disowns(
            candidate, challenge, candidate_session, want
        ):  # else the candidate's forward is at fault
            seed = challenge.seed
            detail = f"its session disagreed with {candidate.peer_id}'s forward (seed {seed}): {verdict.describe()}"
            self._outvoted(reference.peer_id, detail)

    def _undecided(self, peer_id: str, reason: str, retry_in: float = CHALLENGE_RETRY) -> None:
        """The node stays in probation, unrouted, and is challenged again in ``retry_in`` seconds (a third node may
        have come by then; 0: at the next look, against another reference)."""
        then = "challenged again" if retry_in == 0 else "waiting for a third node to break the tie"
        self.book.nodes[peer_id].reason = f"{reason}; {then}"
        self._retry[peer_id] = asyncio.get_running_loop().time() + retry_in
        self.counts["challenge", "undecided"] += 1
        logger.warning("node %s stays in probation: %s", peer_id, self.book.nodes[peer_id].reason)

    def _fail(self, peer_id: str, reason: str) -> None:
        self.book.failed(peer_id, reason)
        self.counts["challenge", "failed"] += 1
        logger.warning("node %s is not routed: %s", peer_id, reason)

    async def _tie_break(
        self,
        view: SwarmView,
        candidate: ServerRecord,
        reference: ServerRecord,
        challenge: Challenge,
        got: torch.Tensor,
    ) -> tuple[Comparison, str] | None:
        """The candidate disagreed with an unverified reference (a first node, never compared with anyone): a third
        node over the same blocks (in probation too, but not failed) decides; when it sides with the candidate, the
        reference is outvoted. None when there is no third node yet."""
        start, end = challenge.blocks
        thirds = [
            s
            for s in view.online()
            if s.peer_id not in (candidate.peer_id, reference.peer_id)
            and s.covers(start, end)
            and self.book.nodes.get(s.peer_id, _NEW).state not in (Verification.FAILED, Verification.DISTRUSTED)
        ]
        if not thirds:
            return None
        third = max(thirds, key=lambda s: reference_order(candidate, s, self.book.reputation(s.peer_id)))
        try:
            want = await forward_outputs(
                self._p2p, third.peer_id, challenge.blocks, challenge.inputs, self.settings.timeout, self._auth
            )
        except SwarmError as error:  # the third's garbage or silence says nothing about the candidate
            logger.info("third node %s did not answer a tie-break's forward: %s", third.peer_id, error)
            if isinstance(error, MalformedReply | BadReceipt):  # garbage is evidence against the third itself
                self._outvoted(third.peer_id, f"answered a challenge's forward with garbage: {error}")
            return None
        verdict = judge(challenge, candidate, third, got, want)
        if verdict.agrees:
            outvoted = f"outvoted at {candidate.peer_id}'s challenge by it and {third.peer_id} (seed {challenge.seed})"
            self._outvoted(reference.peer_id, outvoted)
        return verdict, f"blocks {start}:{end} against {third.peer_id} (seed {challenge.seed})"

    def bad_receipt(self, peer_id: str, error: str) -> None:
        """A step reply of the node did not carry its valid receipt: cut its trust as an outvote would."""
        if not self.settings.enabled:
            return
        self.counts["receipt", "invalid"] += 1
        reason = f"sent a step reply without a valid receipt: {error}"
        if self.book.lost(peer_id, reason, outvoted=True):
            logger.warning("node %s is out of routing: %s", peer_id, reason)

    # -- spot checks ---------------------------------------------------------------------------------------------

    def observe(
        self,
        hop: Hop,
        history: list[tuple[int, torch.Tensor]],
        output: torch.Tensor,
        adapter: str | None = None,
        receipt: Receipt | None = None,
    ) -> None:
        """A step ``hop`` served (``history``: every input the session gave it, this step's last; ``output``: this
        step's [1, T, D]; ``adapter``: the session's LoRA adapter; ``receipt``: the node's signed statement of the
        step, kept with the check as its evidence): maybe re-run it elsewhere in the background."""
        if not self.settings.enabled or not history or self.settings.check_rate <= 0:
            return
        step_tokens = history[-1][1].shape[1]
        total = sum(chunk.shape[1] for _, chunk in history)
        chance = self.book.check_probability(hop.peer_id, step_tokens, total, self.settings.check_rate)
        if self._random.random() >= chance or self._view is None:
            return
        if len(self._checks) >= self.settings.max_checks:
            self.counts["spot", "skipped"] += 1
            return
        check = SpotCheck(hop, list(history), output, adapter, receipt)
        task = asyncio.create_task(self._spot_check(check, self._view))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _spot_check(self, check: SpotCheck, view: SwarmView) -> None:
        try:
            result = await run_spot_check(self._p2p, self._auth, self.book, view, check, self.settings.timeout)
        except Exception as error:
            self.counts["spot", "error"] += 1
            logger.info("spot check of node %s could not run: %s", check.hop.peer_id, error)
            return
        self.counts[result.kind, result.outcome] += 1
        if result.outcome != "agreed" and check.receipt is not None:
            logger.warning(
                "node %s lost a spot check (%s); its %s", check.hop.peer_id, result.outcome, check.receipt.describe()
            )
        for peer, node in self.book.nodes.items():
            if node.state is Verification.DISTRUSTED and peer not in self._announced_out:
                self._announced_out.add(peer)
                logger.warning("node %s is out of routing (reputation %.2f): %s", peer, node.reputation, node.reason)
