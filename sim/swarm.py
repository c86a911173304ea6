"""Simulated nodes and the DHT records they announce; placement by our own span choice.

A node joins by ``choose_start`` over the records it reads (its own JOINING record is announced at once, so later
joiners see the span as taken), loads its weights, goes ONLINE, re-announces every ``ANNOUNCE_PERIOD`` and checks
``choose_new_start`` every ``BALANCE_PERIOD`` — the same functions and defaults as ``swarm_node.server``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.swarm.view import SwarmView
from shared.server_records import NodeState, ServerRecord
from sim.geography import City
from sim.hardware import MAX_BATCH, NodeHardware
from swarm_node.span_choice import block_throughputs, choose_new_start, choose_start

ANNOUNCE_PERIOD = 10.0  # swarm_node --announce-period default
RECORD_TTL = 2 * ANNOUNCE_PERIOD + 5  # what swarm_node.server announces with
OFFLINE_TTL = 5.0
BALANCE_PERIOD = 60.0  # swarm_node --balance-period default
BALANCE_QUALITY = 0.75  # swarm_node --balance-quality default
DRAIN_TIMEOUT = 60.0  # swarm_node --drain-timeout default


@dataclass(eq=False)
class SimNode:
    index: int
    hw: NodeHardware
    city: City
    last_mile: float  # one-way seconds to the city's backbone
    slowdown: float = 1.0  # > 1: computes this many times slower than its GPU would (and announces so)
    state: NodeState = NodeState.JOINING
    start: int = 0
    end: int = 0
    reserved: int = 0  # KV tokens held by open sessions
    sessions: Counter[int] = field(default_factory=Counter)  # session index: its hops here (two, after failovers)
    queue_depth: int = 0
    gone: bool = False
    moves: int = 0
    moving_to: int | None = None  # announced while draining and loading for a move (``ServerRecord.moving_to``)
    # Opens this node holds until it has room (``swarm_node.cache_pool``'s wait), oldest first: each is called when
    # room frees and says whether it is done here (took the room, or no longer waits).
    waiters: list[Callable[[], bool]] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return f"n{self.index:05d}"

    @property
    def span(self) -> int:
        return self.hw.num_blocks

    @property
    def serving(self) -> bool:
        return not self.gone and self.state is NodeState.ONLINE

    @property
    def throughput(self) -> float:
        return self.hw.throughput / self.slowdown

    @property
    def capacity(self) -> float:
        return self.hw.capacity / self.slowdown

    def room(self) -> int:
        return self.hw.cache_tokens - self.reserved

    def record(self) -> ServerRecord:
        return ServerRecord(
            peer_id=self.peer_id,
            start=self.start,
            end=self.end,
            state=self.state,
            throughput=self.throughput if self.state is not NodeState.JOINING else 0.0,
            cache_tokens_left=max(0, self.room()),
            cache_tokens_total=self.hw.cache_tokens,
            queue_depth=self.queue_depth,
            moving_to=self.moving_to,
            version="sim",
            protocol=1,
        )


class Dht:
    """Records by peer with their expiry; readers see the unexpired ones (a crashed node's record outlives it)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.records: dict[str, tuple[ServerRecord, float]] = {}
        self.announcements = 0
        # What the DHT holds is a function of (now, announcements so far): readers at the same instant with no
        # announcement between them get the same dict and the same view, so what is derived from a view (routing's
        # server table, the simulator's route memo) is shared instead of rebuilt for each of a thousand readers.
        self._servers: tuple[float, int, dict[str, ServerRecord]] | None = None
        self._view: SwarmView | None = None

    def announce(self, node: SimNode, now: float) -> None:
        ttl = OFFLINE_TTL if node.state is NodeState.OFFLINE else RECORD_TTL
        self.records[node.peer_id] = (node.record(), now + ttl)
        self.announcements += 1

    def servers(self, now: float) -> dict[str, ServerRecord]:
        """The unexpired records (shared between readers at the same state: do not change the dict)."""
        if self._servers is None or self._servers[:2] != (now, self.announcements):
            records = {peer: record for peer, (record, until) in self.records.items() if until > now}
            self._servers = (now, self.announcements, records)
        return self._servers[2]

    def view(self, now: float) -> SwarmView:
        servers = self.servers(now)
        if self._view is None or self._view.servers is not servers:
            # A record's expiration grows with each announcement: gateways tell a newer record by it (departures,
            # room refusals), as they do with the DHT's.
            announced = {peer: self.records[peer][1] for peer in servers}
            self._view = SwarmView(self.num_blocks, servers, now, announced)
        return self._view


def join_start(dht: Dht, node: SimNode, now: float) -> int:
    """Where a joining node places itself: ``choose_start`` over what it reads."""
    servers = dht.servers(now).values()
    return choose_start(block_throughputs(servers, dht.num_blocks), node.span)


def balance_move(dht: Dht, node: SimNode, now: float) -> int | None:
    """Where a serving node should move to, by ``choose_new_start`` over what it reads (None: stay)."""
    servers = dht.servers(now)
    me = servers.get(node.peer_id)
    if me is None or me.state is not NodeState.ONLINE:
        return None
    return choose_new_start(servers.values(), me, dht.num_blocks, BALANCE_QUALITY)


def queue_depth(present: float) -> int:
    """Steps waiting beyond a full batch, as the node's batcher would report."""
    return max(0, round(present - MAX_BATCH))
