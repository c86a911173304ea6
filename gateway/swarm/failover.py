"""A chain's failover: a failed hop's blocks routed again, the new nodes replayed its exact inputs.

When a node fails, ``recovery`` says what that teaches the router (ban, out until it announces again, or nothing for
a full node) and whether the chain goes on: only the failed node's block range is routed again, the new nodes are
replayed the exact inputs the lost node had received, and the step goes on. When no live node serves the range, the
chain waits for one (``wait`` seconds, counted in the router's ``waiting`` and logged); when only full nodes do (full as
a refusal said, or as their records and the refusals since read: ``routing.short_of_room``), it waits on one for
room. The caller never notices beyond the delay. A new chain that some nodes refused for room is
opened again whole (``reopen``), the full nodes first, so that it holds no room while it waits for some. A chain in
the middle of a step does the same once a node its lost range must use still has no room after a wait
(``ChainReopened``): it lets go of every node and opens again whole, replayed up to the step, which then starts over.

The chain owns one ``Failover`` and hands it its segment list; the failover edits that list in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from gateway.swarm.node_session import NodeSession, TreeInput
from gateway.swarm.recovery import DEFAULT_FAILOVER_WAIT, ROOM_WAIT, WAIT_POLL, Recovery, recovery_for
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from gateway.swarm.segment import Segment
from shared.errors import BadReceipt, MissingBlocks, format_block_ranges

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ChainReopened(Exception):
    """The chain let go of every node and opened again whole, replayed up to the step in progress: the step starts
    over from its first hop (``Failover.replace`` with ``restart_at``)."""


@dataclass
class _Busy:
    """Nodes an opening waits on for room and routes around: those that refused it for want of room, and those a
    route took though routing read them as short of room (``routing.short_of_room``). Asked without a wait, such a
    node refused and the next route took another like it: four in five of a full 100-node swarm's refusals and of
    its routes (``bench/README.md``, stop 53). One only read as short may have room all the same (its record was
    made while this chain's own session held it): it is asked after the others and waited on only while the opening
    holds nothing, so that no room is held while a node waits."""

    nodes: set[str] = field(default_factory=set)
    short: set[str] = field(default_factory=set)  # of ``nodes``: read as short of room, and none refused it yet

    def refused(self, peer_id: str) -> None:
        self.nodes.add(peer_id)
        self.short.discard(peer_id)

    def read_short(self, peer_ids: frozenset[str]) -> None:
        self.short |= peer_ids - self.nodes
        self.nodes |= peer_ids


class _StillFull(Exception):
    """A node the lost range must use refused room again after a wait, while the chain holds its other nodes."""

    def __init__(self, hop: Hop, error: BaseException, busy: _Busy, deadline: float) -> None:
        super().__init__(str(error))
        self.hop, self.error, self.busy, self.deadline = hop, error, busy, deadline


class _ReplacementFailed(Exception):
    def __init__(self, hop: Hop, error: BaseException, waited: bool) -> None:
        super().__init__(str(error))
        self.hop = hop
        self.error = error
        self.waited = waited  # the node was asked to hold the open until it had room


@dataclass(frozen=True)
class FailoverPolicy:
    """How hard a chain tries: node failures it absorbs (capacity refusals and waits do not count), and how long
    it waits for a lost range to be served again."""

    max_failovers: int = 5
    wait: float = DEFAULT_FAILOVER_WAIT


class Failover:
    """Replaces failed segments of one chain. ``new_session`` opens nothing: it builds a session for a hop."""

    def __init__(
        self,
        router: Router,
        policy: FailoverPolicy,
        new_session: Callable[[Hop], NodeSession],
        max_length: Callable[[], int],
        adapter: str | None,
    ) -> None:
        self._router = router
        self._left = policy.max_failovers
        self._wait = policy.wait
        self._new_session = new_session
        self._max_length = max_length
        self._adapter = adapter
        self.count = 0  # node failures absorbed so far

    async def replace(
        self, segments: list[Segment], failed: Segment, error: BaseException, restart_at: int | None = None
    ) -> int:
        """Put new segments over ``failed``'s blocks into ``segments``, replayed up to where it was; returns the
        index just after them. Raises ``error`` (or a later one) when the chain gives up.

        ``restart_at``: the position of a step in progress that may start over from the first hop. Then, should a
        node the range must use still have no room after a wait, the chain lets go of every node and opens again
        whole, replayed up to that position, and ``ChainReopened`` is raised: a chain that held its other nodes while
        it waited kept their room from everyone, and after a region went dark every chain waited on a node full of
        chains waiting on another (the simulator's finding, ``bench/README.md``, stop 46)."""
        await self.drop(failed)
        let_go = restart_at is not None and len(segments) > 1
        try:
            replacement = await self._open_range(failed, [(failed.session.hop, error)], let_go=let_go)
        except _StillFull as full:
            logger.info("node %s still has no room: letting go of the chain while it waits", full.hop.peer_id)
            await self._open_whole(segments, [(full.hop, full.error)], restart_at, full.busy, full.deadline)
            raise ChainReopened from full.error
        index = segments.index(failed)
        segments[index : index + 1] = replacement
        return index + len(replacement)

    async def reopen(self, segments: list[Segment], refused: list[tuple[Segment, BaseException]]) -> None:
        """A new chain some of whose nodes refused it for want of room: every segment is dropped and the whole chain
        opens again as one range, the nodes that refused first (waited on for room when nothing else serves their
        blocks). A chain that held its other nodes while it waited kept a quarter of a full swarm's KV memory from
        any session that could decode (the simulator's finding, ``bench/README.md``, stop 45)."""
        await self._open_whole(segments, [(s.session.hop, error) for s, error in refused])

    async def _open_whole(
        self,
        segments: list[Segment],
        lost: list[tuple[Hop, BaseException]],
        position: int | None = None,
        busy: _Busy | None = None,
        deadline: float | None = None,
    ) -> None:
        """Every segment dropped (a dropped one is skipped) and the whole chain opened again through the failover,
        the nodes of ``lost`` first, replayed its first hop's inputs before ``position`` (a new chain has none)."""
        first = segments[0]  # the failed segment itself when it was the first: dropped, its inputs still here
        await asyncio.gather(*(self.drop(segment) for segment in segments))
        whole = Hop(lost[0][0].peer_id, first.session.hop.start, segments[-1].session.hop.end)
        template = Segment(self._new_session(whole), list(first.history), first.tree)  # never opened
        if position is not None:
            template.truncate(position)
        segments[:] = await self._open_range(template, lost, busy=busy, deadline=deadline)

    async def _open_range(
        self,
        failed: Segment,
        lost: list[tuple[Hop, BaseException]],
        let_go: bool = False,
        busy: _Busy | None = None,
        deadline: float | None = None,
    ) -> list[Segment]:
        """New segments for ``failed``'s blocks once the router has learnt what ``lost`` (each hop's failure) teach;
        raises the last error when the chain gives up, and ``_StillFull`` (``let_go``) when a node refuses room
        again after a wait. ``busy`` and ``deadline``: those of the failover this one goes on from."""
        deadline = time.monotonic() + self._wait if deadline is None else deadline
        busy = _Busy() if busy is None else busy  # waited on for room, never banned
        for hop, error in lost[:-1]:
            await self._learn(hop, error, busy, deadline)
        hop, error = lost[-1]
        waited = False
        while True:
            if let_go and waited and recovery_for(error) is Recovery.BUSY:
                raise _StillFull(hop, error, busy, deadline)
            await self._learn(hop, error, busy, deadline)
            try:
                return await self._build_replacement(failed, busy, deadline)
            except _ReplacementFailed as failure:
                hop, error, waited = failure.hop, failure.error, failure.waited

    async def _learn(self, hop: Hop, error: BaseException, busy: _Busy, deadline: float) -> None:
        """Tell the router what ``hop``'s failure means (``recovery``); raises ``error`` when the chain gives up."""
        recovery = recovery_for(error)
        if recovery is Recovery.FAIL or (recovery is not Recovery.BUSY and self._left <= 0):
            raise error
        if time.monotonic() >= deadline:
            raise error
        self._router.record_failure(hop.peer_id, recovery, tokens=self._max_length())
        if isinstance(error, BadReceipt):  # an output nobody signs for is a lie as far as trust goes
            self._router.record_bad_receipt(hop.peer_id, error)
        blocks = f"{hop.start}:{hop.end}"
        if recovery is Recovery.BUSY:
            if hop.peer_id in busy.nodes:  # refused twice in a row even with a wait: do not spin on it
                await asyncio.sleep(min(WAIT_POLL, max(0.0, deadline - time.monotonic())))
            busy.refused(hop.peer_id)
            logger.info("node %s has no room for blocks %s (%s): elsewhere, or wait", hop.peer_id, blocks, error)
            return
        self._left -= 1
        self.count += 1
        self._router.stats.failovers += 1
        logger.warning("node %s failed (%s: %s); re-routing blocks %s", hop.peer_id, recovery.value, error, blocks)

    async def _build_replacement(self, failed: Segment, busy: _Busy, deadline: float) -> list[Segment]:
        """New segments for ``failed``'s blocks with its history replayed; ``_ReplacementFailed`` names the hop that
        failed (every new segment is closed then)."""
        hop = failed.session.hop
        hops = await self._route_or_wait(hop.start, hop.end, frozenset(busy.nodes), deadline)
        busy.read_short(self._router.short_of_room(hops, self._max_length()))
        segments = [Segment(self._new_session(h)) for h in hops]
        pusher = failed.session.pusher
        for segment in segments:
            segment.session.pusher, pusher = pusher, segment.session.hop.peer_id
        inputs, tree = failed.history, failed.tree  # a tree step's branches too: the next step keeps one

        # The busy nodes open first, those only read as short last of them: none of the others holds room for this
        # chain while one of them waits for some.
        def order(segment: Segment) -> tuple[bool, bool]:
            peer = segment.session.hop.peer_id
            return peer not in busy.nodes, peer in busy.short

        opened = False
        for segment in sorted(segments, key=order):
            peer = segment.session.hop.peer_id
            waits = peer in busy.nodes and not (opened and peer in busy.short)
            room_wait = min(ROOM_WAIT, max(0.0, deadline - time.monotonic())) if waits else 0.0
            await self._opened_or_dropped(segments, segment, segment.session.open(room_wait), waited=room_wait > 0)
            opened = True
        for segment in segments:
            outputs = await self._opened_or_dropped(segments, segment, segment.session.replay(inputs, tree))
            self._router.stats.record_replay(sum(chunk.shape[1] for _, chunk in inputs))
            segment.history, segment.tree = inputs, tree
            if tree is not None:
                tree = TreeInput(tree.position, outputs.pop()[1], tree.parents)
            inputs = outputs
        return segments

    async def _opened_or_dropped(
        self, segments: list[Segment], segment: Segment, call: Awaitable[T], waited: bool = False
    ) -> T:
        """``call``'s result; if it fails, every new segment is dropped and ``_ReplacementFailed`` names its hop
        (``waited``: the call was an open that waited for room)."""
        try:
            return await call
        except BaseException as error:  # cancelled too: the new sessions are in no chain yet, none else closes them
            await asyncio.shield(asyncio.gather(*(self.drop(s) for s in segments)))
            if isinstance(error, Exception):
                raise _ReplacementFailed(segment.session.hop, error, waited) from error
            raise

    async def _route_or_wait(self, start: int, end: int, busy: frozenset[str], deadline: float) -> list[Hop]:
        """Hops over [start, end); while no live node serves them, waits for one (up to ``deadline``)."""
        with contextlib.ExitStack() as waiting:
            first = True
            while True:
                try:
                    hops = await self._route(start, end, busy, fresh=first)
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

    async def _route(self, start: int, end: int, busy: frozenset[str], fresh: bool) -> list[Hop]:
        return await self._router.route(
            self._max_length(), start, end, fresh=fresh, avoid=busy, max_age=WAIT_POLL / 2, adapter=self._adapter
        )

    async def drop(self, segment: Segment) -> None:
        """Release a segment's room and close its node session (whatever the node says)."""
        if segment.session.closed:
            return
        self._router.release([segment.session.hop])
        with contextlib.suppress(Exception):
            await segment.session.close()
