"""The simulated world: nodes, the DHT, gateways and sessions on one virtual clock, and what it measures."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from gateway.swarm.bans import BanList
from gateway.swarm.departures import Departures
from gateway.swarm.room_refusals import RoomRefusals
from gateway.swarm.routing import Hop, RouteRequest, RoutingMode, plan_route, short_of_room
from gateway.swarm.view import SwarmView
from sim import geography
from sim.dataplane import GATEWAY_WORK
from sim.events import EventQueue
from sim.geography import City
from sim.hardware import ModelShape, NodeHardware
from sim.route_plan import planned
from sim.route_plan.planned import PLAN_PERIOD, DemandMeter, PlannedChain
from sim.route_plan.view_plan import GatewayDemand, RoutePlan, plan_of
from sim.swarm import Dht, SimNode
from sim.workload import Request

GATEWAY_LAST_MILE = 0.0005  # one-way seconds: gateways sit in data centres
VIEW_MAX_AGE = 10.0  # a gateway re-reads the DHT at most this often (its monitor; nodes re-announce every 10 s)


@dataclass(eq=False)
class Session:
    index: int
    gateway: SimGateway
    request: Request
    arrived: float
    hops: list[Hop] = field(default_factory=list)
    done: float = 0.0  # tokens decoded
    decoding: bool = False  # False while routing, prefilling or failing over
    failovers: int = 0
    finished: float | None = None
    lost: bool = False
    held: list[Hop] = field(default_factory=list)  # nodes that took it for a range still opening (not in ``hops``)
    reopened: int = 0  # times its whole chain was let go while it waited for room, and opened again


class SimGateway:
    """One gateway: its view of the DHT, RTTs to nodes, bans and refusals for room on the virtual clock, its load;
    routes with the real ``plan_route``, timing each call (or, where the world says so, whole chains by its own
    plan, ``route_plan.view_plan``, remade every ``PLAN_PERIOD`` from its view and what every gateway announces)."""

    def __init__(self, world: World, city: City, mode: RoutingMode) -> None:
        self.world = world
        self.city = city
        self.mode = mode
        self.bans = BanList(clock=lambda: world.clock.now)
        self.refusals = RoomRefusals(clock=lambda: world.clock.now)  # the gateway's Router keeps the same
        self.load: Counter[str] = Counter()
        self.rtts: dict[str, float] = {}
        self._records: SwarmView | None = None  # the DHT's, as last read
        self._view: SwarmView | None = None  # the records less departed nodes
        self.departures = Departures(clock=lambda: world.clock.now)
        self._rtts_for: SwarmView | None = None  # the view whose nodes' RTTs ``rtts`` holds
        self._routes: dict[tuple[object, ...], list[Hop]] = {}  # searches made (``_memo_key``)
        self._routes_structure: tuple[tuple[str, int, int, float, float], ...] = ()
        self.meter = DemandMeter()
        self.plan: RoutePlan | None = None
        self._planned_at = -np.inf

    def view(self, fresh: bool = False) -> SwarmView:
        """The DHT's records less the nodes this gateway saw die (``Departures``, as the gateway's router)."""
        now = self.world.clock.now
        if fresh or self._records is None or now - self._records.fetched_at > VIEW_MAX_AGE:
            self._records, self._view = self.world.dht.view(now), None
        if self._view is None:
            self._view = self.departures.filter(self._records)
        return self._view

    def depart(self, peer_id: str) -> None:
        """A node found dead (a failed dial, no answer to a ping: ``Recovery.GONE``) is out of routing until it
        announces again."""
        self.departures.depart(peer_id)
        self._view = None

    def route(self, session: Session, start: int, end: int, avoid: frozenset[str], fresh: bool) -> list[Hop]:
        view = self.view(fresh)
        self._measure(view)
        request = RouteRequest(
            session.request.max_length,
            start,
            end,
            rtts=self.rtts,
            banned=self.bans.banned() | avoid,
            load=self.load,
            push=True,
            room_left=self.refusals.room_left(view),
        )
        if self.world.planned_routing and start == 0 and end == self.world.model.num_blocks:
            plan = self._plan(view, request)
            if plan is not None and plan.chains:
                try:
                    return planned.pick(plan.chains, view, request, self.world.plan_rng)
                except planned.NoPlannedRoom:
                    if not plan.below_optimum:
                        raise  # at the optimum: wait for room on the plan
        key = self._memo_key(view, request)
        if key is not None and key in self._routes:
            return list(self._routes[key])
        began = time.process_time()
        try:
            hops = plan_route(view, request, self.mode)
        finally:
            self.world.route_times.append(time.process_time() - began)
        if key is not None:
            self._routes[key] = hops
        return list(hops)

    def short_of_room(self, hops: list[Hop], max_length: int) -> frozenset[str]:
        """The hops' nodes this gateway reads as short of room (``Router.short_of_room``)."""
        view = self.view()
        return short_of_room(view, RouteRequest(max_length, room_left=self.refusals.room_left(view)), hops)

    def _measure(self, view: SwarmView) -> None:
        """RTTs to the view's nodes not measured yet (the gateway's prober measures every node it sees)."""
        if self._rtts_for is not view:
            for peer in view.servers:
                if peer not in self.rtts:
                    self.rtts[peer] = self.world.rtt_to(self.city, GATEWAY_LAST_MILE, self.world.nodes[peer])
            self._rtts_for = view

    def _plan(self, view: SwarmView, request: RouteRequest) -> RoutePlan | None:
        """The plan, remade every ``PLAN_PERIOD`` from what every gateway announces (its CPU time in
        ``World.plan_times``)."""
        now = self.world.clock.now
        if now - self._planned_at < PLAN_PERIOD:
            return self.plan
        began = time.process_time()
        gateways = [g.announced(view, request.max_length) for g in self.world.gateways]
        previous = self.plan.every if self.plan is not None else ()
        me = self.world.gateways.index(self)
        self.plan = plan_of(view, gateways, me, GATEWAY_WORK, previous=previous)
        self._planned_at = now
        self.world.plan_times.append(time.process_time() - began)
        return self.plan

    def announced(self, view: SwarmView, length: int) -> GatewayDemand:
        """What this gateway tells the others for their plans (``length``: its sessions' if none arrived yet)."""
        self._measure(view)
        now = self.world.clock.now
        return GatewayDemand(self.rtts, self.meter.demand(now), self.meter.held_length(now) or float(length))

    def _memo_key(self, view: SwarmView, request: RouteRequest) -> tuple[object, ...] | None:
        """What a ``min_latency`` route depends on, so that a search already made is not made again: this
        gateway's RTTs (fixed per node), the blocks, who is banned or passed over, the serving nodes' spans,
        announced throughputs and occupancy (in tenths), and which of them are short of room for the session by
        their records or by a refusal since (``plan_route`` reads ``cache_tokens_left`` and ``room_left`` otherwise
        only as ``< max_length``). In a busy swarm most opens repeat the same searches (the same full nodes found
        one by one, view after view), so they are kept while the serving nodes' spans, throughputs and occupancy
        stay the same. ``max_throughput`` reads this
        gateway's load, which changes with every open: not kept."""
        if self.mode is not RoutingMode.MIN_LATENCY:
            return None
        known = view.memo.get("sim_routing_inputs")
        if not isinstance(known, _RoutingInputs):
            known = view.memo["sim_routing_inputs"] = _RoutingInputs.of(view)
        # ``is`` first: views in a row mostly share one structure, and comparing it costs a pass over every node.
        if known.structure is not self._routes_structure and known.structure != self._routes_structure:
            self._routes.clear()
            self._routes_structure = known.structure
        refused = frozenset(peer for peer, left in request.room_left.items() if left < request.max_length)
        return (request.start, request.end, request.banned, known.short_of(request.max_length) | refused)


@dataclass(frozen=True)
class _RoutingInputs:
    """A view's serving nodes as routing prices them: spans, throughputs and occupancy (``structure``), and their room
    (``peers_by_room``, fewest tokens left first; ``rooms`` the matching sorted counts)."""

    structure: tuple[tuple[str, int, int, float, float], ...]
    peers_by_room: tuple[str, ...]
    rooms: npt.NDArray[np.int64]
    # ``short_of``'s answers by max_length: a view serves many opens, and sessions share a few lengths
    short: dict[int, frozenset[str]] = field(default_factory=dict, compare=False)

    @staticmethod
    def of(view: SwarmView) -> _RoutingInputs:
        online = view.online()
        structure = tuple(sorted((s.peer_id, s.start, s.end, s.throughput, s.occupancy) for s in online))
        by_room = sorted(online, key=lambda s: (s.cache_tokens_left, s.peer_id))
        rooms = np.array([s.cache_tokens_left for s in by_room], dtype=np.int64)
        return _RoutingInputs(structure, tuple(s.peer_id for s in by_room), rooms)

    def short_of(self, max_length: int) -> frozenset[str]:
        """The nodes without room for a session of ``max_length`` tokens."""
        known = self.short.get(max_length)
        if known is None:
            known = self.short[max_length] = frozenset(
                self.peers_by_room[: int(np.searchsorted(self.rooms, max_length, side="left"))]
            )
        return known


@dataclass
class Metrics:
    times: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)  # decoded tokens/s
    bound: list[float] = field(default_factory=list)  # the per-node max-flow bound then (it sizes the arrivals)
    path_bound: list[float] = field(default_factory=list)  # the path LP's bound (steady window only, else nan)
    path_kept_node: int = 0  # path-bound samples where pricing gave up and the per-node bound stood in
    path_open: int = 0  # path-bound samples whose gap did not close in time (still a bound, a looser one)
    compute_bound: list[float] = field(default_factory=list)  # the bound without the KV-memory limit
    offered: list[float] = field(default_factory=list)  # tokens/s the arrivals ask for then (bursts included)
    decoding: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # blocks no ONLINE node serves
    finished: int = 0
    lost: int = 0
    refused: int = 0
    failovers: int = 0
    moves: int = 0
    ttft: list[float] = field(default_factory=list)


class World:
    def __init__(self, model: ModelShape, seed: int, mode: RoutingMode) -> None:
        self.model = model
        self.rng = np.random.default_rng(seed)
        self.clock = EventQueue()
        self.dht = Dht(model.num_blocks)
        self.nodes: dict[str, SimNode] = {}
        self.node_list: list[SimNode] = []  # by index
        self.gateways = [SimGateway(self, geography.city(name), mode) for name in geography.GATEWAY_CITIES]
        self.sessions: dict[int, Session] = {}
        self.metrics = Metrics()
        self.route_times: list[float] = []
        self._node_rtts: dict[tuple[str, str], float] = {}
        self.decoding: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64]]] = {}
        self.at_node: npt.NDArray[np.float64] | None = None  # the data plane's last solution
        # The path LP's last chains (``dataflow.path``): its next solve starts from these
        self.bound_chains: list[PlannedChain] = []
        self.planned_routing = False  # gateways route whole chains by their own plans (``SimGateway._plan``)
        self.plan_times: list[float] = []  # CPU seconds of each gateway's plan
        self.plan_rng = np.random.default_rng(seed + 1)  # its own stream: the arrivals' draws stay the same
        self.offered: Callable[[float], float] = lambda now: 0.0  # tokens/s the arrivals ask for at a time
        self.balancing = True  # nodes run their rebalancing check (a scenario may turn it off to compare)

    def rtt_to(self, city: City, last_mile: float, node: SimNode) -> float:
        return geography.rtt(city, node.city, last_mile, node.last_mile)

    def rtt_between(self, a: SimNode, b: SimNode) -> float:
        key = (a.peer_id, b.peer_id)
        if key not in self._node_rtts:
            self._node_rtts[key] = geography.rtt(a.city, b.city, a.last_mile, b.last_mile)
        return self._node_rtts[key]

    def nearest_gateway(self, user: City) -> SimGateway:
        """The gateway a user there goes to: the nearest."""
        return min(self.gateways, key=lambda g: geography.distance_km(user, g.city))

    def gateway_shares(self) -> list[float]:
        """Each gateway's share of the users (of the arrivals): the cities' shares by their nearest gateway."""
        shares = [0.0] * len(self.gateways)
        for city in geography.CITIES:
            shares[self.gateways.index(self.nearest_gateway(city))] += city.share
        return [share / sum(shares) for share in shares]

    def complete(self, session: Session) -> bool:
        """The session's hops cover every block, in order."""
        ends = [0] + [h.end for h in session.hops]
        return ends[-1] == self.model.num_blocks and all(h.start == e for h, e in zip(session.hops, ends, strict=False))

    def chains_changed(self, session: Session) -> None:
        """Keep the decoding sessions' chains (node indices, blocks, links) for the data plane."""
        if not (session.decoding and self.complete(session)):
            self.decoding.pop(session.index, None)
            return
        nodes = [self.nodes[h.peer_id] for h in session.hops]
        gateway = session.gateway
        links = [self.rtt_to(gateway.city, GATEWAY_LAST_MILE, nodes[0]) / 2]
        links += [self.rtt_between(a, b) / 2 for a, b in zip(nodes, nodes[1:], strict=False)]
        links[-1] += self.rtt_to(gateway.city, GATEWAY_LAST_MILE, nodes[-1]) / 2
        self.decoding[session.index] = (
            np.array([n.index for n in nodes]),
            np.array([h.end - h.start for h in session.hops], dtype=float),
            np.array(links),
        )

    def new_node(self, hw: NodeHardware, city: City, last_mile: float, slowdown: float = 1.0) -> SimNode:
        node = SimNode(len(self.node_list), hw, city, last_mile, slowdown)
        self.node_list.append(node)
        self.nodes[node.peer_id] = node
        return node

    def serving(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.serving]

    def carrying(self) -> list[SimNode]:
        """The nodes that may decode now: those serving, and those draining (moving, or leaving gracefully) that
        still hold open sessions: they decode them on their old span until the drain deadline. The bounds are over
        these: a bound over the serving ones alone fell below ours after an event, when many nodes drain."""
        return [n for n in self.nodes.values() if n.serving or (not n.gone and bool(n.sessions))]
