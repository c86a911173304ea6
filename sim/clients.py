"""Session events: arrive, open a chain (the real ``plan_route``, then each node's own check), prefill, decode,
fail over a lost hop, finish. What a gateway learns from a failed open is what ``gateway.swarm.recovery`` teaches:
a dead node is out of routing until it announces again (``gateway.swarm.departures``; it was banned here before
stop 46, and a ban gives way where every server of a block is banned or busy: chains kept dialling the dead node),
a draining or moved one is passed over, and a full one is read as full by the next opens until it announces again
(``gateway.swarm.room_refusals``).

A chain opens as ``gateway.swarm.chain_session`` opens one: every hop's node is asked; if all take it, it holds
their room; if some refuse for want of room, it lets go of the others and the whole chain opens again
(``failover.reopen``) as an ``_Opening``: routed past the nodes that refused (``busy``, with those a route took though
the gateway reads them as short of room: ``routing.short_of_room``), the busy nodes asked first (those only read as
short last among them, and waited on only while the opening holds nothing);
when the route must go through one of them, that node holds the open up to ``ROOM_WAIT`` until it has room
(``swarm_node.cache_pool``; the session holds nothing meanwhile), then the range is routed again after
``WAIT_POLL``. A lost hop's range opens the same way, the rest of the chain held; while nobody serves it, it is
routed again every ``WAIT_POLL`` on a view read then (``failover._route_or_wait``); once a node it must use has
refused room after a wait, the session lets go of its whole chain and opens again whole (``failover.ChainReopened``:
after a region went dark, chains held their room while waiting on nodes full of chains waiting on others, until the
failover wait lost them all). Before stop 45 a session here held
nothing and looked again every ``RETRY_AFTER`` (room a session freed stayed unused until then: 10 % of the KV
memory, with 900 sessions waiting), while the gateway held the nodes that took a new session as it waited for
room on the others (a quarter of the KV memory held by sessions not decoding): ``bench/README.md``, stop 45."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from gateway.swarm.recovery import DEFAULT_FAILOVER_WAIT, ROOM_WAIT, WAIT_POLL
from gateway.swarm.routing import Hop
from shared.errors import MissingBlocks
from shared.kv_charge import pool_tokens
from sim.hardware import STEP_OVERHEAD
from sim.route_plan.planned import NoPlannedRoom
from sim.swarm import SimNode
from sim.workload import Request
from sim.world import GATEWAY_LAST_MILE, Session, SimGateway, World

RETRY_AFTER = 10.0  # seconds a planned chain without room waits before it is routed again
# A session waits for room (new or mid-way) and for a lost range to be served again (mid-way) as long as the gateway's
# failover does (``DEFAULT_FAILOVER_WAIT``), then it is refused (new) or lost; a new session whose route names a
# block nobody serves is refused at once, as the gateway's router answers missing_blocks then.
CRASH_NOTICED = 5.0  # seconds before a gateway notices a dead node (a step's timeout, the liveness ping)


@dataclass(eq=False)
class _Opening:
    """One range of a session being opened (``failover._open_range``'s loop): its route, the nodes that took it so
    far, and the nodes that refused it for room since it began (asked first, and waited on when a route must use
    one)."""

    session: Session
    start: int
    end: int
    deadline: float
    busy: set[str] = field(default_factory=set)
    hops: list[Hop] = field(default_factory=list)
    held: list[Hop] = field(default_factory=list)
    waiting: object | None = None  # set while a node holds the open until it has room: a token for this wait only
    short: set[str] = field(default_factory=set)  # busy ones only read as short of room: none refused it yet
    epoch: int = 0  # the session's ``reopened`` when this opening began: a whole reopen supersedes it

    def __post_init__(self) -> None:
        self.epoch = self.session.reopened

    @property
    def over(self) -> bool:
        return self.session.finished is not None or self.session.lost or self.epoch != self.session.reopened


def arrive(world: World, gateway: SimGateway, request: Request) -> None:
    session = Session(len(world.sessions), gateway, request, world.clock.now)
    world.sessions[session.index] = session
    gateway.meter.opened(request.max_length, world.clock.now)
    _open_chain(world, session, world.clock.now + DEFAULT_FAILOVER_WAIT)


def _open_chain(world: World, session: Session, deadline: float) -> None:
    """Route every block and ask each hop's node; if some refuse for room, open the whole chain again past them."""
    opening = _Opening(session, 0, world.model.num_blocks, deadline)
    try:
        hops = session.gateway.route(session, 0, world.model.num_blocks, frozenset(), fresh=False)
    except MissingBlocks:
        _give_up(world, session)
        return
    except NoPlannedRoom:
        _short_of_plan(world, opening)
        return
    refused = [h for h in hops if not _accepts(world, session, h)]
    if refused:
        opening.busy.update(h.peer_id for h in refused)
        _route(world, opening)
        return
    for hop in hops:
        _hold(world, session, hop)
    _attach(world, session, hops)


def _route(world: World, opening: _Opening, fresh: bool = True) -> None:
    """Route the opening's range past its busy nodes and open its hops (``failover._build_replacement``)."""
    if opening.over:
        return
    if world.clock.now >= opening.deadline:
        _give_up(world, opening.session)
        return
    try:
        opening.hops = opening.session.gateway.route(
            opening.session, opening.start, opening.end, frozenset(opening.busy), fresh=fresh
        )
    except MissingBlocks:  # the gateway reads the DHT again every WAIT_POLL while it waits for a node to serve them
        _route_later(world, opening, WAIT_POLL, fresh=True)
        return
    except NoPlannedRoom:
        _short_of_plan(world, opening)
        return
    opening.held = []
    # Nodes routing reads as short of room are busy from the first ask, waited on while nothing is held
    # (``failover._build_replacement``).
    short = opening.session.gateway.short_of_room(opening.hops, opening.session.request.max_length) - opening.busy
    opening.short |= short
    opening.busy |= short
    _next_hop(world, opening)


def _short_of_plan(world: World, opening: _Opening) -> None:
    opening.session.gateway.meter.short_of_room(world.clock.now)
    _route_later(world, opening, RETRY_AFTER, fresh=False)


def _route_later(world: World, opening: _Opening, after: float, fresh: bool) -> None:
    """Route the range again ``after`` seconds from now (on a view read then with ``fresh``), or give up if the
    deadline comes first."""
    if world.clock.now + after < opening.deadline:
        world.clock.after(after, lambda: _route(world, opening, fresh=fresh))
    else:
        _give_up(world, opening.session)


def _next_hop(world: World, opening: _Opening) -> None:
    """Open the route's hops in order: a node that accepts holds the room; a busy one holds the open until it has
    room; any other refusal drops what the opening holds and routes the range again."""
    session = opening.session
    if opening.over:
        return
    if len(opening.held) == 0:  # the busy nodes first, those read as short last: nothing is held while one waits
        opening.hops.sort(key=lambda h: (h.peer_id not in opening.busy, h.peer_id in opening.short))
    while len(opening.held) < len(opening.hops):
        hop = opening.hops[len(opening.held)]
        node = world.nodes[hop.peer_id]
        busy = hop.peer_id in opening.busy
        if busy and (hop.peer_id not in opening.short or not opening.held) and _full(node, session, hop):
            _wait_for_room(world, opening, node, hop)
            return
        if not _accepts(world, session, hop):
            _refused(world, opening, hop.peer_id, WAIT_POLL if busy else 0.0)
            return
        _hold(world, session, hop)
        opening.held.append(hop)
    if any(world.nodes[h.peer_id].gone for h in opening.held):  # one died while another held the open
        _refused(world, opening, next(h.peer_id for h in opening.held if world.nodes[h.peer_id].gone), 0.0)
        return
    _attach(world, session, opening.held)


def _serves(node: SimNode, hop: Hop) -> bool:
    """The node is up, takes new sessions, and its span holds the hop's blocks."""
    return node.serving and node.start <= hop.start < hop.end <= node.end


def _full(node: SimNode, session: Session, hop: Hop) -> bool:
    """The node serves the hop but has no room for it now: what it would hold an open for."""
    return _serves(node, hop) and node.room() < _charge(node, session, hop)


def _wait_for_room(world: World, opening: _Opening, node: SimNode, hop: Hop) -> None:
    """``node`` holds the open until it has room for ``hop`` or ``ROOM_WAIT`` passes (then a capacity refusal)."""
    wait = opening.waiting = object()

    def admit() -> bool:
        if opening.waiting is not wait or opening.over:
            return True  # no longer waits here
        if _serves(node, hop) and node.room() >= _charge(node, opening.session, hop):  # else the timeout refuses it
            opening.waiting = None
            _hold(world, opening.session, hop)
            opening.held.append(hop)
            world.clock.after(0.0, lambda: _next_hop(world, opening))  # not inside the release that woke it
            return True
        return False

    def timed_out() -> None:
        if opening.waiting is wait and not opening.over:
            opening.waiting = None
            if node.gone:
                opening.session.gateway.depart(node.peer_id)
            elif node.serving:  # still full: a capacity refusal
                opening.session.gateway.refusals.refuse(node.peer_id, opening.session.request.max_length)
                opening.session.gateway.meter.short_of_room(world.clock.now)
                if opening.session.hops:  # mid-stream: let go of the chain rather than hold it while it waits
                    _let_go(world, opening, node.peer_id)
                    return
            _refused(world, opening, node.peer_id, WAIT_POLL)

    node.waiters.append(admit)
    world.clock.after(max(0.0, min(ROOM_WAIT, opening.deadline - world.clock.now)), timed_out)


def _let_go(world: World, opening: _Opening, peer_id: str) -> None:
    """A failover refused room by ``peer_id`` even after a wait lets go of its whole chain (every other opening of
    the session with it) and opens it again whole, ``WAIT_POLL`` later (``failover.ChainReopened``)."""
    session = opening.session
    _release(world, session, session.hops + session.held)
    session.hops, session.held = [], []
    session.reopened += 1
    world.chains_changed(session)
    whole = _Opening(session, 0, world.model.num_blocks, opening.deadline, busy=opening.busy | {peer_id})
    whole.short = opening.short - {peer_id}
    world.clock.after(WAIT_POLL, lambda: _route(world, whole))


def _refused(world: World, opening: _Opening, peer_id: str, pause: float) -> None:
    """Drop what the opening holds and route its range again past ``peer_id``, after ``pause``."""
    session = opening.session
    for hop in opening.held:
        session.held.remove(hop)
    _release(world, session, opening.held)
    opening.held = []
    opening.busy.add(peer_id)
    opening.short.discard(peer_id)  # it refused: waited on first from now on
    if pause > 0:
        world.clock.after(pause, lambda: _route(world, opening))
    else:
        _route(world, opening)


def _accepts(world: World, session: Session, hop: Hop) -> bool:
    node = world.nodes[hop.peer_id]
    if node.gone:
        session.gateway.depart(node.peer_id)
    elif not _serves(node, hop):
        pass  # draining, moved or reloading: out of routing until it announces again
    elif node.room() < _charge(node, session, hop):  # full: a capacity refusal, never a ban
        session.gateway.refusals.refuse(node.peer_id, session.request.max_length)
        session.gateway.meter.short_of_room(world.clock.now)
    else:
        return True
    return False


def _charge(node: SimNode, session: Session, hop: Hop) -> int:
    """The pool tokens the hop's node charges the session (``shared.kv_charge``: its blocks' share)."""
    return pool_tokens(session.request.max_length, hop.end - hop.start, node.span)


def _hold(world: World, session: Session, hop: Hop) -> None:
    """The hop's node takes the session: its room is held from now on."""
    node = world.nodes[hop.peer_id]
    node.reserved += _charge(node, session, hop)
    node.sessions[session.index] += 1
    session.held.append(hop)
    session.gateway.load[hop.peer_id] += 1
    session.gateway.bans.record_success(hop.peer_id)


def _attach(world: World, session: Session, hops: list[Hop]) -> None:
    """Held hops join the chain; they prefill, and the session decodes once its chain is whole."""
    for hop in hops:
        session.held.remove(hop)
    session.hops = sorted(session.hops + hops, key=lambda h: h.start)
    world.chains_changed(session)
    tokens = session.request.prompt + int(session.done)  # a failover replays what the lost node held
    world.clock.after(_prefill_time(world, session, hops, tokens), lambda: _decode(world, session))


def _prefill_time(world: World, session: Session, hops: list[Hop], tokens: int) -> float:
    total = 0.0
    for hop in hops:
        node = world.nodes[hop.peer_id]
        blocks = hop.end - hop.start
        compute = STEP_OVERHEAD + blocks * (node.hw.read_time + tokens * node.hw.token_time)
        total += world.rtt_to(session.gateway.city, GATEWAY_LAST_MILE, node) + compute * node.slowdown
    return total


def _decode(world: World, session: Session) -> None:
    if session.finished is not None or session.lost or session.decoding or not world.complete(session):
        return  # finished, or another hop was lost while this one prefilled (its own open resumes decoding)
    if not session.decoding and session.failovers == 0 and session.done == 0:
        world.metrics.ttft.append(world.clock.now - session.arrived)
    session.decoding = True
    world.chains_changed(session)


def fail_over(world: World, session: Session, node: SimNode, fault: bool) -> None:
    """The hop on ``node`` is lost: release it, and after the gateway notices, route its blocks anew."""
    lost = [h for h in session.hops if h.peer_id == node.peer_id]
    if not lost or session.finished is not None or session.lost:
        return
    session.decoding = False
    session.failovers += 1
    world.metrics.failovers += 1
    _release(world, session, lost)
    session.hops = [h for h in session.hops if h.peer_id != node.peer_id]
    world.chains_changed(session)
    if fault:
        session.gateway.depart(node.peer_id)
    deadline = world.clock.now + DEFAULT_FAILOVER_WAIT
    delay = CRASH_NOTICED if fault else 0.0
    for hop in lost:  # each its own opening, as the gateway replaces each failed segment
        opening = _Opening(session, hop.start, hop.end, deadline)
        world.clock.after(delay, functools.partial(_route, world, opening))


def finish(world: World, session: Session) -> None:
    session.finished = world.clock.now
    session.gateway.meter.finished(session.request.output)
    session.decoding = False
    world.metrics.finished += 1
    _release(world, session, session.hops)
    world.chains_changed(session)


def _give_up(world: World, session: Session) -> None:
    if session.hops or session.failovers:
        session.lost = True
        world.metrics.lost += 1
    else:
        world.metrics.refused += 1
        session.lost = True
    _release(world, session, session.hops + session.held)
    session.hops, session.held = [], []
    world.chains_changed(session)


def _release(world: World, session: Session, hops: list[Hop]) -> None:
    for hop in hops:
        node = world.nodes[hop.peer_id]
        if node.sessions[session.index] > 0:  # else its node let it go already
            node.sessions[session.index] -= 1
            if node.sessions[session.index] == 0:
                del node.sessions[session.index]
            node.reserved -= _charge(node, session, hop)
            node.waiters = [admit for admit in node.waiters if not admit()]  # the pool wakes those waiting for room
        session.gateway.load[hop.peer_id] -= 1
        if session.gateway.load[hop.peer_id] <= 0:
            del session.gateway.load[hop.peer_id]
