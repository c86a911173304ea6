"""The gateway's router: the swarm view, measured round-trip times, bans and its own load, fed to ``routing``.

It also keeps what failures taught it (``recovery`` says which failure teaches what): bans for faults, departed
nodes hidden until they announce again, nodes that refused for room read as that short until they announce again
(``room_refusals``), the liveness watch on nodes, and who waits for which blocks.

RTTs are probed with the node's info RPC (an exponential moving average, refreshed in the background and measured
on demand for nodes never seen before). The load counts sessions this gateway has open on each node, so
``max_throughput`` spreads concurrent sessions even before the nodes' announcements catch up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P

from gateway.swarm.bans import BanList
from gateway.swarm.departures import Departures
from gateway.swarm.liveness import Liveness
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.recovery import Recovery
from gateway.swarm.room_refusals import RoomRefusals
from gateway.swarm.routing import Hop, RouteRequest, RoutingMode, plan_route, short_of_room
from gateway.swarm.verify.verifier import Verifier
from gateway.swarm.view import SwarmView
from shared.background import Periodic
from shared.errors import MissingBlocks, SwarmError, format_block_ranges
from shared.membership import CallAuth
from shared.reachability import open_paths
from shared.rpc_client import fetch_info

logger = logging.getLogger(__name__)

RTT_SMOOTHING = 0.5  # weight of a new sample in the moving average
PROBE_TIMEOUT = 2.0
# Seconds routing does not wait on probing a node again after it left a probe unanswered (a dead node's record lingers
# until it expires, a frozen or unreachable one's as long as it announces): without this, every route waited
# PROBE_TIMEOUT on it. The background prober still tries it each probe period, and routing prices it meanwhile at
# routing.UNKNOWN_RTT.
PROBE_RETRY = 30.0
# Seconds a new session may be routed on the last swarm view while a newer one is fetched (nodes re-announce every
# 10 s and their departures are noticed by failing sessions, pings and departures.py).
ROUTE_STALE_OK = 30.0


@dataclass
class RouterStats:
    """Churn this gateway has handled since it started (exported as Prometheus counters)."""

    failovers: int = 0  # node sessions replaced mid-generation
    prefix_replays: int = 0  # replacement node sessions that were replayed the lost node's inputs
    replayed_tokens: int = 0
    bans: int = 0
    departures: int = 0  # nodes taken out of routing until they announce again (dead, frozen, draining, moved)
    capacity_refusals: int = 0  # opens a full node refused (never a ban)
    relayed_hops: int = 0  # decode steps whose hidden states the gateway sent to a node
    pushed_hops: int = 0  # decode steps whose hidden states went node to node
    # What the control plane costs a gateway, measured where a swarm's size shows: the DHT lookups behind its views
    # (background refreshes, fresh views for failovers and gaps) and its route choices.
    swarm_lookups: int = 0
    swarm_lookup_seconds: float = 0.0
    route_plans: int = 0  # plan_route calls (new sessions' routes, failovers' replacements)
    route_plan_seconds: float = 0.0  # in plan_route itself: the choice, the view already in hand
    routes: int = 0  # Router.route calls
    route_seconds: float = 0.0  # whole calls: the view (a lookup when stale), probes of new nodes, the choice

    def record_lookup(self, seconds: float) -> None:
        self.swarm_lookups += 1
        self.swarm_lookup_seconds += seconds

    def record_replay(self, tokens: int) -> None:
        if tokens:  # a session lost before its first step has nothing to replay
            self.prefix_replays += 1
            self.replayed_tokens += tokens

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class Router:
    def __init__(
        self,
        monitor: SwarmMonitor,
        p2p: P2P,
        mode: RoutingMode = RoutingMode.MIN_LATENCY,
        bans: BanList | None = None,
        probe_period: float = 10.0,
        auth: CallAuth | None = None,
        allowed_peers: frozenset[str] | None = None,
        verifier: Verifier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.monitor = monitor
        self.mode = mode
        self.bans = bans or BanList()
        self.rtts: dict[str, float] = {}
        self.load: Counter[str] = Counter()
        self.auth = auth or CallAuth(None, "")
        self.stats = RouterStats()
        self.allowed_peers = allowed_peers  # None: any node that announces itself (with the swarm secret, if any)
        self._p2p = p2p
        self._probe_period = probe_period
        self._unanswered: dict[str, float] = {}  # peer -> when it last left a probe unanswered (``clock``)
        self._clock = clock
        self._prober = Periodic("rtt-probe", self._probe_period, self._probe_all, "RTT probing failed")
        self.departures = Departures()
        self.room_refusals = RoomRefusals()
        self.liveness = Liveness(p2p, self.auth)
        self.waiting: Counter[str] = Counter()  # sessions waiting for a node, by block range ("15:30")
        self.last_view: SwarmView | None = None  # the latest view() returned (the prober refreshes it)
        self.verifier = verifier  # None: every announced node is trusted (no probation, no spot checks)

    def start(self) -> None:
        self._prober.start()
        if self.verifier is not None:
            self.verifier.start()

    def trusted(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may carry user traffic now (its sessions fail over when it may not)."""
        return self.verifier is None or self.verifier.routable(peer_id)

    async def close(self) -> None:
        if self.verifier is not None:
            await self.verifier.close()
        await self._prober.stop()

    async def route(
        self,
        max_length: int,
        start: int = 0,
        end: int | None = None,
        mode: RoutingMode | None = None,
        fresh: bool = False,
        avoid: frozenset[str] = frozenset(),
        max_age: float | None = None,
        push: bool = False,
        adapter: str | None = None,
    ) -> list[Hop]:
        """Plan hops over blocks [start, end) and count them as this gateway's load until ``release``.

        ``avoid``: nodes to pass over like banned ones (used only where nothing else serves a block); ``push``: the
        chain sends hidden states node to node (routing counts the links between nodes); ``adapter``: only nodes
        serving this LoRA adapter."""
        # A new session routes on the last view (up to ROUTE_STALE_OK old, refreshed behind it); a gap in it is
        # checked against a fresh one before it is an error. Failovers ask for fresh views themselves.
        stale_ok = ROUTE_STALE_OK if not fresh and max_age is None else 0.0
        began = time.perf_counter()
        try:
            while True:
                view = await self.view(fresh, max_age, stale_ok)
                await self._probe(view, self._unmeasured(view))
                request = self._route_request(view, max_length, start, end, avoid, push, adapter)
                planning = time.perf_counter()
                try:
                    hops = plan_route(view, request, mode or self.mode)
                except MissingBlocks:
                    if stale_ok == 0.0:
                        raise
                    fresh, stale_ok = True, 0.0
                    continue
                finally:
                    self.stats.route_plans += 1
                    self.stats.route_plan_seconds += time.perf_counter() - planning
                break
        finally:
            self.stats.routes += 1
            self.stats.route_seconds += time.perf_counter() - began
        self.load.update(hop.peer_id for hop in hops)
        return hops

    def _route_request(
        self,
        view: SwarmView,
        max_length: int,
        start: int,
        end: int | None,
        avoid: frozenset[str],
        push: bool,
        adapter: str | None,
    ) -> RouteRequest:
        """What the planner weighs: our round trips, bans and load, and the verifier's exclusions and penalties."""
        return RouteRequest(
            max_length,
            start,
            end,
            rtts=dict(self.rtts),
            banned=self.bans.banned() | avoid | self._silent(),
            load=dict(self.load),
            push=push,
            adapter=adapter,
            excluded=self.verifier.excluded(view) if self.verifier else frozenset(),
            penalties=self.verifier.penalties(view) if self.verifier else {},
            room_left=self.room_refusals.room_left(view),
        )

    def short_of_room(self, hops: list[Hop], max_length: int) -> frozenset[str]:
        """The hops' nodes that the latest view and the refusals since read as short of room for ``max_length``
        tokens (``routing.short_of_room``)."""
        view = self.last_view
        if view is None:
            return frozenset()
        return short_of_room(view, RouteRequest(max_length, room_left=self.room_refusals.room_left(view)), hops)

    def release(self, hops: Iterable[Hop]) -> None:
        self.load.subtract(hop.peer_id for hop in hops)
        self.load = +self.load  # drop zero counts

    def record_failure(self, peer_id: str, recovery: Recovery = Recovery.FAULT, tokens: int = 0) -> None:
        """What a node's failure teaches routing, by its recovery (see recovery.py); ``tokens``: the session's
        size, which a refusal for room (BUSY) says the node has no room for until it announces again."""
        if recovery.until_announced:
            self.departures.depart(peer_id)
            self.stats.departures += 1
            logger.warning("node %s is out of routing until it announces again (%s)", peer_id, recovery.value)
        if recovery.bans:
            duration = self.bans.record_failure(peer_id)
            self.stats.bans += 1
            logger.warning("banning node %s for %.0fs", peer_id, duration)
        if recovery is Recovery.BUSY:
            self.stats.capacity_refusals += 1
            if tokens > 0:
                self.room_refusals.refuse(peer_id, tokens)

    def record_bad_receipt(self, peer_id: str, error: BaseException) -> None:
        """A step reply of ``peer_id`` came without a valid receipt: the verifier cuts its trust (banned already)."""
        if self.verifier is not None:
            self.verifier.bad_receipt(peer_id, str(error))

    def record_success(self, peer_id: str) -> None:
        self.bans.record_success(peer_id)

    @contextlib.contextmanager
    def waiting_for(self, start: int, end: int) -> Iterator[None]:
        """Count a session as waiting for a node to serve blocks [start, end) while in the block."""
        label = format_block_ranges(list(range(start, end)))
        self.waiting[label] += 1
        try:
            yield
        finally:
            self.waiting[label] -= 1
            self.waiting = +self.waiting

    async def view(self, fresh: bool = False, max_age: float | None = None, stale_ok: float = 0.0) -> SwarmView:
        """What routing sees: the DHT's records, less nodes outside the allowlist and departed nodes."""
        view = await self.monitor.view(fresh=fresh, max_age=max_age, stale_ok=stale_ok)
        self.last_view = self.departures.filter(self._allowed(view))
        if self.verifier is not None:
            self.verifier.watch(self.last_view)
        return self.last_view

    def _allowed(self, view: SwarmView) -> SwarmView:
        if self.allowed_peers is None:
            return view
        servers = {peer: s for peer, s in view.servers.items() if peer in self.allowed_peers}
        return SwarmView(view.num_blocks, servers, view.fetched_at, view.announced)

    async def _probe(self, view: SwarmView, peer_ids: Sequence[str]) -> None:
        if peer_ids:
            # p2pd reaches a relayed node only once it has dialled the node's circuit; then it keeps the connection.
            await open_paths(self._p2p, {p: view.servers[p].relay_addrs for p in peer_ids if p in view.servers})
            await asyncio.gather(*(self._probe_one(peer) for peer in peer_ids))

    def _unmeasured(self, view: SwarmView) -> list[str]:
        """Online nodes with no RTT estimate that routing should probe before it routes: not those that left a probe
        unanswered in the last ``PROBE_RETRY`` seconds."""
        silent = self._silent()
        return [s.peer_id for s in view.online() if s.peer_id not in self.rtts and s.peer_id not in silent]

    def _silent(self) -> frozenset[str]:
        """Nodes that never answered a probe and left one unanswered in the last ``PROBE_RETRY`` seconds: routed
        like banned ones, only where nothing else serves a block (dead or frozen, most likely; a route through one
        costs its session a step timeout)."""
        now = self._clock()
        for peer_id in [p for p, when in self._unanswered.items() if now - when > PROBE_RETRY]:
            del self._unanswered[peer_id]
        return frozenset(p for p in self._unanswered if p not in self.rtts)

    async def _probe_one(self, peer_id: str) -> None:
        try:
            _, rtt = await fetch_info(self._p2p, peer_id, PROBE_TIMEOUT, self.auth)
        except SwarmError:
            self._unanswered[peer_id] = self._clock()
            return  # an unreachable node keeps its old estimate; failing sessions ban it
        self._unanswered.pop(peer_id, None)
        old = self.rtts.get(peer_id)
        self.rtts[peer_id] = rtt if old is None else (1 - RTT_SMOOTHING) * old + RTT_SMOOTHING * rtt

    async def _probe_all(self) -> None:
        view = await self.view()
        await self._probe(view, [s.peer_id for s in view.online()])
