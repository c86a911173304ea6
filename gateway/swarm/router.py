"""The gateway's router: the swarm view, measured round-trip times, bans and its own load, fed to ``routing``.

RTTs are probed with the node's info RPC (an exponential moving average, refreshed in the background and measured
on demand for nodes never seen before). The load counts sessions this gateway has open on each node, so
``max_throughput`` spreads concurrent sessions even before the nodes' announcements catch up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P

from gateway.swarm.bans import BanList
from gateway.swarm.routing import Hop, RouteRequest, RoutingMode, plan_route
from gateway.swarm.view import SwarmMonitor, SwarmView
from shared.errors import SwarmError
from shared.membership import CallAuth
from shared.rpc_client import fetch_info

logger = logging.getLogger(__name__)

RTT_SMOOTHING = 0.5  # weight of a new sample in the moving average
PROBE_TIMEOUT = 2.0


@dataclass
class RouterStats:
    """Churn this gateway has handled since it started (exported as Prometheus counters)."""

    failovers: int = 0  # node sessions replaced mid-generation
    prefix_replays: int = 0  # replacement node sessions that were replayed the lost node's inputs
    replayed_tokens: int = 0
    bans: int = 0
    relayed_hops: int = 0  # decode steps whose hidden states the gateway sent to a node
    pushed_hops: int = 0  # decode steps whose hidden states went node to node

    def record_replay(self, tokens: int) -> None:
        if tokens:  # a session lost before its first step has nothing to replay
            self.prefix_replays += 1
            self.replayed_tokens += tokens

    def as_dict(self) -> dict[str, int]:
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
        self._prober: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._prober = asyncio.create_task(self._probe_forever())

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober

    async def route(
        self,
        max_length: int,
        start: int = 0,
        end: int | None = None,
        mode: RoutingMode | None = None,
        fresh: bool = False,
    ) -> list[Hop]:
        """Plan hops over blocks [start, end) and count them as this gateway's load until ``release``."""
        view = self._allowed(await self.monitor.view(fresh=fresh))
        await self._probe([s.peer_id for s in view.online() if s.peer_id not in self.rtts])
        request = RouteRequest(
            max_length, start, end, rtts=dict(self.rtts), banned=self.bans.banned(), load=dict(self.load)
        )
        hops = plan_route(view, request, mode or self.mode)
        self.load.update(hop.peer_id for hop in hops)
        return hops

    def release(self, hops: Iterable[Hop]) -> None:
        self.load.subtract(hop.peer_id for hop in hops)
        self.load = +self.load  # drop zero counts

    def record_failure(self, peer_id: str) -> None:
        duration = self.bans.record_failure(peer_id)
        self.stats.bans += 1
        logger.warning("banning node %s for %.0fs", peer_id, duration)

    def record_success(self, peer_id: str) -> None:
        self.bans.record_success(peer_id)

    async def view(self, fresh: bool = False) -> SwarmView:
        return self._allowed(await self.monitor.view(fresh=fresh))

    def _allowed(self, view: SwarmView) -> SwarmView:
        if self.allowed_peers is None:
            return view
        servers = {peer: s for peer, s in view.servers.items() if peer in self.allowed_peers}
        return SwarmView(view.num_blocks, servers, view.fetched_at)

    async def _probe(self, peer_ids: Sequence[str]) -> None:
        if peer_ids:
            await asyncio.gather(*(self._probe_one(peer) for peer in peer_ids))

    async def _probe_one(self, peer_id: str) -> None:
        try:
            _, rtt = await fetch_info(self._p2p, peer_id, PROBE_TIMEOUT, self.auth)
        except SwarmError:
            return  # an unreachable node keeps its old estimate; failing sessions ban it
        old = self.rtts.get(peer_id)
        self.rtts[peer_id] = rtt if old is None else (1 - RTT_SMOOTHING) * old + RTT_SMOOTHING * rtt

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._probe_period)
            try:
                view = await self.view()
                await self._probe([s.peer_id for s in view.online()])
            except Exception:
                logger.warning("RTT probing failed", exc_info=True)
