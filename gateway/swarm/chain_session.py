"""A session through every block: a chain of node sessions that carries hidden states.

A node that fails is replaced by ``gateway.swarm.failover`` (the chain owns one ``Failover``): only its block range
is routed again, the new nodes are replayed its exact inputs, and the step goes on.

With push on (``ChainSession(push=True)``), a decode step goes to the chain's first node together with the rest of
the route and each node pushes its output straight to the next one; the gateway hears every hop's input and output
(``gateway.swarm.push_step``), so failover replays exactly as before.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType

import torch
from hivemind.p2p import P2P

from gateway.metrics import chain_opened
from gateway.swarm.failover import ChainReopened, Failover, FailoverPolicy
from gateway.swarm.frames import Frame
from gateway.swarm.node_session import NodeSession
from gateway.swarm.push_step import push_step
from gateway.swarm.recovery import Recovery, recovery_for
from gateway.swarm.router import Router
from gateway.swarm.routing import UNKNOWN_RTT, Hop
from gateway.swarm.segment import Segment
from gateway.swarm.step_links import StepLinks
from shared.errors import NodeDistrusted, NodeUnreachable
from shared.receipts import Receipt
from shared.wire import MAX_ROW_TOKENS

__all__ = ["ChainSession", "NodeSession", "Segment"]

logger = logging.getLogger(__name__)

DEFAULT_POLICY = FailoverPolicy()


class ChainSession:
    """A session through every block: hidden states go in at block 0 and come out after the last block.

    After ``failover.max_failovers`` node failures (capacity refusals and waits do not count) the last error is
    raised."""

    def __init__(
        self,
        p2p: P2P,
        router: Router,
        max_length: int,
        step_timeout: float,
        links: StepLinks | None = None,
        failover: FailoverPolicy = DEFAULT_POLICY,
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
        self._segments: list[Segment] = []
        self._steps = 0  # steps so far: the first (the prompt) goes on each node's own stream
        self._last_row: int | None = None  # the latest step's position if it went by the step links (a push may follow)
        # tokens the nodes hold: a step below it rewinds them (a verify step after rejected drafts); None after
        # pipelined frames, which may have stopped midway (hops holding different lengths): the next step relays
        self._stored: int | None = 0
        self._frames: list[Frame] = []  # pipelined verify frames sent, in order (``frame``)
        self._restart_at: int | None = None  # the plain step in progress: its position (``Failover.replace``)
        self._failover = Failover(router, failover, self._new_session, lambda: self._max_length, adapter)
        self.closed = False

    @property
    def failovers(self) -> int:
        """Node failures this chain absorbed so far."""
        return self._failover.count

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
        await self._settle()
        self._max_length = max_length
        results = await asyncio.gather(
            *(segment.session.resize(max_length) for segment in self._segments), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def truncate(self, length: int, branch: list[int] | None = None) -> None:
        """Every node forgets its stored tokens from ``length`` on (speculative drafts the model rejected), and so
        does each hop's replay history; ``branch``: the last tree step's kept branch (slots) moves to the positions
        before ``length`` first. Raises the first node's error, like ``resize``."""
        self._check_open()
        await self._settle()
        results = await asyncio.gather(
            *(segment.session.truncate(length, self._branch_of(segment, branch)) for segment in self._segments),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for segment in self._segments:
            if branch and segment.tree is not None:
                segment.keep_branch(length, branch)
            segment.truncate(length)
        self._stored = length if self._stored is None else min(self._stored, length)  # every hop holds that now
        self._last_row = None  # the nodes forgot their latest step: a push may not rewind them

    @staticmethod
    def _branch_of(segment: Segment, branch: list[int] | None) -> list[int] | None:
        """What a hop is told of a kept branch: only a node holding the tree step has one to keep."""
        return branch if branch and segment.tree is not None else None

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
            failed = [(s, r) for s, r in zip(opening, results, strict=True) if isinstance(r, BaseException)]
            if failed and all(isinstance(r, Exception) and recovery_for(r) is Recovery.BUSY for _, r in failed):
                await self._failover.reopen(self._segments, failed)  # holds no room while it waits for some
                return
            for segment, result in failed:
                await self.fail_over(segment, result)
        except BaseException:
            await self.close()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def step(
        self, hidden: torch.Tensor, position: int, tree: list[int] | None = None, branch: list[int] | None = None
    ) -> torch.Tensor:
        """hidden: [1, T, D] embeddings of new tokens at position... -> [1, T, D] output of the last block.

        ``tree``: the tokens are speculative branches (``wire.Step.tree``); ``branch``: the last tree step's kept
        branch (its slots) becomes the positions before ``position`` first."""
        self._check_open()
        chain_opened()  # the request's first step ends its queue time (later calls are no-ops)
        await self._settle()
        plain = tree is None and not branch  # tree steps and the step naming a kept branch go on hops' own streams
        row = plain and self._steps > 0 and hidden.shape[1] <= MAX_ROW_TOKENS  # by the step links (NodeSession.step)
        pushed, self._steps = plain and self._pushable(hidden, position), self._steps + 1
        self._restart_at = position if plain else None  # a plain step may start over on a chain opened again whole
        try:
            if pushed:
                output = await push_step(self, hidden, position)
            else:  # a prompt, a tree, or a rewind further back than the last step's own positions
                output = await self.relay(hidden, position, 0, tree, branch)
        except ChainReopened:
            output = await self._restarted(hidden, position)
        finally:
            self._restart_at = None
        self._stored = position + hidden.shape[1]
        self._last_row = position if row else None
        return output

    def frame(self, hidden: torch.Tensor, position: int, ahead: bool = False) -> Frame:
        """Send a verify step (hidden [1, T, D] at ``position``, a chain of drafts) as a pipelined frame: it leaves
        now, after the frames still in flight and before any later one (``gateway.swarm.frames``; ``ahead``: it
        continues the frame before it, assumed kept whole); ``step`` waits for the frames to stop before it steps."""
        self._check_open()
        self._frames = [frame for frame in self._frames if frame.running]
        before = self._frames[-1] if self._frames else None
        frame = Frame(self, list(self._segments), hidden, position, before, ahead)
        self._frames.append(frame)
        self._steps += 1
        self._stored, self._last_row = None, None
        return frame

    async def _settle(self) -> None:
        """Void the frames in flight and wait until they stop: an ordinary step, a roll-back or a resize never runs
        beside them (nor fails over a hop a frame is reading)."""
        frames, self._frames = self._frames, []
        for frame in frames:
            frame.void()
        for frame in frames:
            await frame.stopped()

    def _pushable(self, hidden: torch.Tensor, position: int) -> bool:
        """Whether a step goes node to node (when push pays): a step after the chain's first of at most
        ``MAX_ROW_TOKENS`` (a decode step, a verify step) at the end of what the nodes hold, or one that rewinds only
        over the latest step's own positions (its rejected drafts) — the nodes' step slots hold that step, and a
        push past its position is in order."""
        if not self.pushes_decode or not self._steps or hidden.shape[1] > MAX_ROW_TOKENS:
            return False
        if position == self._stored:
            return True
        return self._last_row is not None and self._stored is not None and self._last_row < position < self._stored

    async def _restarted(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """The step again from the first hop, relayed, on a chain opened again whole (as often as that happens)."""
        while True:
            try:
                return await self.relay(hidden, position, 0)
            except ChainReopened:
                continue

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

    async def relay(
        self,
        hidden: torch.Tensor,
        position: int,
        index: int,
        tree: list[int] | None = None,
        branch: list[int] | None = None,
    ) -> torch.Tensor:
        """The step from segment ``index`` on, each hop's output sent on by the gateway (failing over as needed; a
        replacement is replayed the tree step it replaces, so a kept branch means the same on it)."""
        while index < len(self._segments):
            segment = self._segments[index]
            kept = self._branch_of(segment, branch)
            try:
                self.check_trusted(segment)
                output = await segment.session.step(hidden, position, tree=tree, branch=kept)
            except Exception as error:
                await self.fail_over(segment, error)
                continue  # the replacement now sits at the same index
            segment.record(position, hidden, tree, kept)
            if tree is None:  # spot checks replay a chain of inputs: a tree step is not one
                self.observed(segment, output)
            self._router.record_success(segment.session.hop.peer_id)
            self._router.stats.relayed_hops += hidden.shape[1] == 1
            hidden = output
            index += 1
        return hidden

    async def close(self) -> None:
        # Shielded: a cancelled request must still release every node's cache room.
        self.closed = True
        frames, self._frames = self._frames, []
        for frame in frames:
            frame.cancel()  # frames read the sessions' streams: stopped before the sessions drain them
        await asyncio.shield(asyncio.gather(*(frame.stopped() for frame in frames)))
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

    def observed(self, segment: Segment, output: torch.Tensor, receipt: Receipt | None = None) -> None:
        """A step the segment's node served (its history ends with this step's input): maybe spot-checked.
        ``receipt``: the step's (default: the session's latest; a frame passes its own, others may follow it)."""
        verifier = self._router.verifier
        if verifier is not None:
            receipt = receipt if receipt is not None else segment.session.last_receipt
            verifier.observe(segment.session.hop, segment.history, output, self.adapter, receipt)

    def _check_open(self) -> None:
        if self.closed:  # with no segments left, a step would return its input unchanged
            raise NodeUnreachable("the chain session is closed")

    def _new_session(self, hop: Hop) -> NodeSession:
        router = self._router
        return NodeSession(
            self._p2p, hop, self._max_length, self._timeout, router.auth, self._links, router.liveness, self.adapter
        )

    async def fail_over(self, failed: Segment, error: BaseException) -> None:
        """Replace ``failed`` by new segments over the same blocks, replayed up to where it was."""
        after = await self._failover.replace(self._segments, failed, error, self._restart_at)
        await self._name_pusher(after)

    async def _name_pusher(self, index: int) -> None:
        """The hop after a replacement learns its new predecessor; if it cannot, this chain relays from now on."""
        if not self.push or not 0 < index < len(self._segments):
            return
        try:
            await self._segments[index].session.allow_push(self._segments[index - 1].session.hop.peer_id)
        except Exception as error:  # the step itself will find out whether the node is gone
            logger.info("no push into %s (%s); relaying", self._segments[index].session.hop.peer_id, error)
            self.push = False
