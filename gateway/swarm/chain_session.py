"""A session through every block: a chain of node sessions that carries hidden states, and its failover.

When a node fails, ``recovery`` says what that teaches the router (ban, out until it announces again, or nothing for
a full node) and whether the chain goes on: only the failed node's block range is routed again, the new nodes are
replayed the exact inputs the lost node had received, and the step goes on. When no live node serves the range, the
chain waits for one (``failover_wait`` seconds, counted in the router's ``waiting`` and logged); when only full nodes
do, it waits on one for room. The caller never notices beyond the delay.

With push on (``ChainSession(push=True)``), a decode step goes to the chain's first node together with the rest of
the route and each node pushes its output straight to the next one; the gateway hears every hop's input and output
(``gateway.swarm.push_step``), so failover replays exactly as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from types import TracebackType

import torch
from hivemind.p2p import P2P

from gateway.metrics import chain_opened
from gateway.swarm.node_session import NodeSession
from gateway.swarm.push_step import push_step
from gateway.swarm.recovery import Recovery, recovery_for
from gateway.swarm.router import Router
from gateway.swarm.routing import UNKNOWN_RTT, Hop
from gateway.swarm.step_links import StepLinks
from shared.errors import MissingBlocks, NodeDistrusted, NodeUnreachable, format_block_ranges

__all__ = ["ChainSession", "NodeSession", "Segment"]

logger = logging.getLogger(__name__)

WAIT_POLL = 1.0  # seconds between looks at the swarm while waiting for a node to serve a lost range
ROOM_WAIT = 10.0  # seconds a full node is asked to hold an open until it has room (then the chain asks again)
DEFAULT_FAILOVER_WAIT = 120.0


class _ReplacementFailed(Exception):
    def __init__(self, hop: Hop, error: BaseException) -> None:
        super().__init__(str(error))
        self.hop = hop
        self.error = error


@dataclass
class Segment:
    """One hop of a chain and every input it was given, kept so a replacement can be replayed exactly."""

    session: NodeSession
    history: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, hidden [1, T, D])

    def record(self, position: int, hidden: torch.Tensor) -> None:
        """Remember an input; inputs at or after ``position`` are forgotten first (the node rewinds the same way)."""
        self.truncate(position)
        self.history.append((position, hidden))

    def truncate(self, length: int) -> None:
        """Forget the inputs from position ``length`` on (the node was rolled back there)."""
        kept = []
        for start, chunk in self.history:
            if start >= length:
                break
            kept.append((start, chunk[:, : length - start]))
        self.history = kept


class ChainSession:
    """A session through every block: hidden states go in at block 0 and come out after the last block.

    After ``max_failovers`` node failures (capacity refusals and waits do not count) the last error is raised.
    """

    def __init__(
        self,
        p2p: P2P,
        router: Router,
        max_length: int,
        step_timeout: float,
        max_failovers: int = 5,
        links: StepLinks | None = None,
        failover_wait: float = DEFAULT_FAILOVER_WAIT,
        push: bool = False,
        push_min_rtt: float = 0.0,
        adapter: str | None = None,
    ) -> None:
        self._p2p = p2p
        self.adapter = adapter  # the LoRA adapter every node runs the session with (None: the base model)
        self._links = links
        self.push = push and links is not None  # decode steps go node to node (needs the batch links)
        self._push_min_rtt = push_min_rtt  # ... where a later node is at least this far from the gateway
        self._router = router
        self._max_length = max_length
        self._timeout = step_timeout
        self._failovers_left = max_failovers
        self._failover_wait = failover_wait
        self._segments: list[Segment] = []
        self._stored = 0  # tokens the nodes hold: a step below it rewinds them, which only a relayed step may do
        self.failovers = 0
        self.closed = False

    @property
    def hops(self) -> list[Hop]:
        return [segment.session.hop for segment in self._segments]

    @property
    def max_length(self) -> int:
        return self._max_length

    async def resize(self, max_length: int) -> None:
        """Every node's room becomes ``max_length`` tokens, what they hold kept (a kept conversation's next turn).

        Raises the first node's error, leaving the chain unusable: the caller closes it (a fresh chain is cheaper to
        get right than a failover at a new length)."""
        self._check_open()
        self._max_length = max_length
        results = await asyncio.gather(
            *(segment.session.resize(max_length) for segment in self._segments), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def truncate(self, length: int) -> None:
        """Every node forgets its stored tokens from ``length`` on (speculative drafts the model rejected), and so
        does each hop's replay history. Raises the first node's error, like ``resize``."""
        self._check_open()
        results = await asyncio.gather(
            *(segment.session.truncate(length) for segment in self._segments), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for segment in self._segments:
            segment.truncate(length)
        self._stored = min(self._stored, length)

    async def __aenter__(self) -> ChainSession:
        await self.open()
        return self

    async def open(self) -> None:
        """Route every block and open a session on each hop (failing over as steps do); closed again on failure."""
        try:
            hops = await self._router.route(self._max_length, push=self.push, adapter=self.adapter)
            self._segments = [Segment(self._new_session(hop)) for hop in hops]
            for before, segment in zip(self._segments, self._segments[1:], strict=False):
                segment.session.pusher = before.session.hop.peer_id
            opening = list(self._segments)  # a failover may replace one segment by several
            results = await asyncio.gather(*(s.session.open() for s in opening), return_exceptions=True)
            for segment, result in zip(opening, results, strict=True):
                if isinstance(result, BaseException):
                    await self._fail_over(segment, result)
        except BaseException:
            await self.close()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden: [1, T, D] embeddings of new tokens at position... -> [1, T, D] output of the last block."""
        self._check_open()
        chain_opened()  # the request's first step ends its queue time (later calls are no-ops)
        if hidden.shape[1] == 1 and position == self._stored and self.pushes_decode:
            output = await push_step(self, hidden, position)
        else:  # a prefill, a speculative verify step, or a step after rejected drafts (a rewind)
            output = await self.relay(hidden, position, 0)
        self._stored = position + hidden.shape[1]
        return output

    @property
    def pushes_decode(self) -> bool:
        """Whether a decode step (one token) goes node to node now."""
        return self.push and len(self._segments) > 1 and self._push_pays()

    def _push_pays(self) -> bool:
        """A push saves half a round trip per later hop; on loopback that is less than its extra messages cost."""
        rtts = self._router.rtts
        return any(rtts.get(s.session.hop.peer_id, UNKNOWN_RTT) >= self._push_min_rtt for s in self._segments[1:])

    @property
    def segments(self) -> list[Segment]:
        return self._segments

    @property
    def router(self) -> Router:
        return self._router

    async def relay(self, hidden: torch.Tensor, position: int, index: int) -> torch.Tensor:
        """The step from segment ``index`` on, each hop's output sent on by the gateway (failing over as needed)."""
        while index < len(self._segments):
            segment = self._segments[index]
            try:
                self.check_trusted(segment)
                output = await segment.session.step(hidden, position)
            except Exception as error:
                await self._fail_over(segment, error)
                continue  # the replacement now sits at the same index
            segment.record(position, hidden)
            self.observed(segment, output)
            self._router.record_success(segment.session.hop.peer_id)
            self._router.stats.relayed_hops += hidden.shape[1] == 1
            hidden = output
            index += 1
        return hidden

    async def close(self) -> None:
        # Shielded: a cancelled request must still release every node's cache room.
        self.closed = True
        sessions = [segment.session for segment in self._segments]
        self._router.release(s.hop for s in sessions if not s.closed)  # a dropped segment was released already
        self._segments = []
        await asyncio.shield(asyncio.gather(*(s.close() for s in sessions), return_exceptions=True))

    def check_trusted(self, segment: Segment) -> None:
        """Raises ``NodeDistrusted`` when the segment's node is out of routing by the verifier: the step moves to a
        trusted node (with the inputs it was given replayed), never waiting on a check. The later hops keep what
        they computed from its earlier outputs: tokens already sampled cannot change."""
        peer = segment.session.hop.peer_id
        if not self._router.trusted(peer):
            raise NodeDistrusted(f"node {peer} is out of routing: the gateway's checks no longer trust its outputs")

    def observed(self, segment: Segment, output: torch.Tensor) -> None:
        """A step the segment's node served (its history ends with this step's input): maybe spot-checked."""
        verifier = self._router.verifier
        if verifier is not None:
            verifier.observe(segment.session.hop, segment.history, output)

    def _check_open(self) -> None:
        if self.closed:  # with no segments left, a step would return its input unchanged
            raise NodeUnreachable("the chain session is closed")

    def _new_session(self, hop: Hop) -> NodeSession:
        router = self._router
        return NodeSession(
            self._p2p, hop, self._max_length, self._timeout, router.auth, self._links, router.liveness, self.adapter
        )

    async def fail_over(self, failed: Segment, error: BaseException) -> None:
        await self._fail_over(failed, error)

    async def _fail_over(self, failed: Segment, error: BaseException) -> None:
        """Replace ``failed`` by new segments over the same blocks, replayed up to where it was."""
        deadline = time.monotonic() + self._failover_wait
        busy: set[str] = set()  # nodes that refused for want of room during this failover: waited on, never banned
        hop = failed.session.hop
        await self._drop(failed)
        while True:
            await self._learn(hop, error, busy, deadline)
            try:
                replacement = await self._build_replacement(failed, busy, deadline)
            except _ReplacementFailed as failure:
                hop, error = failure.hop, failure.error
                continue
            index = self._segments.index(failed)
            self._segments[index : index + 1] = replacement
            await self._name_pusher(index + len(replacement))
            return

    async def _learn(self, hop: Hop, error: BaseException, busy: set[str], deadline: float) -> None:
        """Tell the router what ``hop``'s failure means (``recovery``); raises ``error`` when the chain gives up."""
        recovery = recovery_for(error)
        if recovery is Recovery.FAIL or (recovery is not Recovery.BUSY and self._failovers_left <= 0):
            raise error
        if time.monotonic() >= deadline:
            raise error
        self._router.record_failure(hop.peer_id, recovery)
        blocks = f"{hop.start}:{hop.end}"
        if recovery is Recovery.BUSY:
            if hop.peer_id in busy:  # refused twice in a row even with a wait: do not spin on it
                await asyncio.sleep(min(WAIT_POLL, max(0.0, deadline - time.monotonic())))
            busy.add(hop.peer_id)
            logger.info("node %s has no room for blocks %s (%s): elsewhere, or wait", hop.peer_id, blocks, error)
            return
        self._failovers_left -= 1
        self.failovers += 1
        self._router.stats.failovers += 1
        logger.warning("node %s failed (%s: %s); re-routing blocks %s", hop.peer_id, recovery.value, error, blocks)

    async def _build_replacement(self, failed: Segment, busy: set[str], deadline: float) -> list[Segment]:
        """New segments for ``failed``'s blocks with its history replayed; ``_ReplacementFailed`` names the hop that
        failed (every new segment is closed then)."""
        hop = failed.session.hop
        hops = await self._route_or_wait(hop.start, hop.end, frozenset(busy), deadline)
        segments = [Segment(self._new_session(h)) for h in hops]
        pusher = failed.session.pusher
        for segment in segments:
            segment.session.pusher, pusher = pusher, segment.session.hop.peer_id
        inputs = failed.history
        for segment in segments:
            peer = segment.session.hop.peer_id
            room_wait = min(ROOM_WAIT, max(0.0, deadline - time.monotonic())) if peer in busy else 0.0
            try:
                await segment.session.open(room_wait)
                outputs = await segment.session.replay(inputs)
            except Exception as error:
                await asyncio.gather(*(self._drop(s) for s in segments))
                raise _ReplacementFailed(segment.session.hop, error) from error
            self._router.stats.record_replay(sum(chunk.shape[1] for _, chunk in inputs))
            segment.history = inputs
            inputs = outputs
        return segments

    async def _route_or_wait(self, start: int, end: int, busy: frozenset[str], deadline: float) -> list[Hop]:
        """Hops over [start, end); while no live node serves them, waits for one (up to ``deadline``)."""
        with contextlib.ExitStack() as waiting:
            first = True
            while True:
                try:
                    hops = await self._router.route(
                        self._max_length,
                        start,
                        end,
                        fresh=first,
                        avoid=busy,
                        max_age=WAIT_POLL / 2,
                        adapter=self.adapter,
                    )
                except MissingBlocks as missing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        logger.error("no node came to serve blocks %s", format_block_ranges(missing.blocks))
                        raise
                    if first:
                        waiting.enter_context(self._router.waiting_for(start, end))
                        logger.warning(
                            "no live node serves blocks %s: waiting up to %.0fs for one to join or come back",
                            format_block_ranges(missing.blocks),
                            left,
                        )
                    first = False
                    await asyncio.sleep(min(WAIT_POLL, left))
                    continue
                if not first:
                    logger.info("blocks %d:%d are served again: resuming", start, end)
                return hops

    async def _name_pusher(self, index: int) -> None:
        """The hop after a replacement learns its new predecessor; if it cannot, this chain relays from now on."""
        if not self.push or not 0 < index < len(self._segments):
            return
        try:
            await self._segments[index].session.allow_push(self._segments[index - 1].session.hop.peer_id)
        except Exception as error:  # the step itself will find out whether the node is gone
            logger.info("no push into %s (%s); relaying", self._segments[index].session.hop.peer_id, error)
            self.push = False

    async def _drop(self, segment: Segment) -> None:
        if segment.session.closed:
            return
        self._router.release([segment.session.hop])
        with contextlib.suppress(Exception):
            await segment.session.close()
