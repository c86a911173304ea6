"""Session events: arrive, open a chain (the real ``plan_route``, then each node's own check), prefill, decode,
fail over a lost hop, finish. What a gateway learns from a failed open is what ``gateway.swarm.recovery`` teaches:
a dead node is banned, a full or departed one is passed over, and a full one is read as full by the next opens
until it announces again (``gateway.swarm.room_refusals``)."""

from __future__ import annotations

from gateway.swarm.recovery import DEFAULT_FAILOVER_WAIT
from gateway.swarm.routing import Hop
from shared.errors import MissingBlocks
from shared.kv_charge import pool_tokens
from shared.server_records import NodeState
from sim.hardware import STEP_OVERHEAD
from sim.route_plan.planned import NoPlannedRoom
from sim.swarm import SimNode
from sim.workload import Request
from sim.world import GATEWAY_LAST_MILE, Session, SimGateway, World

OPEN_TRIES = 16  # routes tried at once at most before the session waits (each failed open teaches the next)
RETRY_AFTER = 10.0  # seconds a session without a chain waits before it tries again (a view refresh)
# A session waits for room (new or mid-way) and for a lost range to be served again (mid-way) as long as the gateway's
# failover does (``DEFAULT_FAILOVER_WAIT``), then it is refused (new) or lost; a new session whose route names a
# block nobody serves is refused at once, as the gateway's router answers missing_blocks then.
CRASH_NOTICED = 5.0  # seconds before a gateway notices a dead node (a step's timeout, the liveness ping)


def arrive(world: World, gateway: SimGateway, request: Request) -> None:
    session = Session(len(world.sessions), gateway, request, world.clock.now)
    world.sessions[session.index] = session
    gateway.meter.opened(request.max_length, world.clock.now)
    _open(world, session, 0, world.model.num_blocks, world.clock.now + DEFAULT_FAILOVER_WAIT)


def _open(world: World, session: Session, start: int, end: int, deadline: float) -> None:
    """Route blocks [start, end) (all of them, or a lost hop's) and open the chain's node sessions."""
    avoid: set[str] = set()
    for attempt in range(OPEN_TRIES):
        try:
            hops = session.gateway.route(session, start, end, frozenset(avoid), fresh=attempt == 1)
        except MissingBlocks:
            if not session.hops and not session.failovers:
                _give_up(world, session)
                return
            break
        except NoPlannedRoom:
            session.gateway.meter.short_of_room(world.clock.now)
            break
        if avoid.intersection(h.peer_id for h in hops):
            break  # every server of some block refused: the gateway waits for room (gateway.swarm.failover)
        refused = next((h for h in hops if not _accepts(world, session, h, avoid)), None)
        if refused is None:
            _opened(world, session, hops)
            return
    if world.clock.now + RETRY_AFTER < deadline:
        world.clock.after(RETRY_AFTER, lambda: _open(world, session, start, end, deadline))
    else:
        _give_up(world, session)


def _accepts(world: World, session: Session, hop: Hop, avoid: set[str]) -> bool:
    node = world.nodes[hop.peer_id]
    if node.gone:
        session.gateway.bans.record_failure(node.peer_id)
    elif node.state is not NodeState.ONLINE or not node.start <= hop.start < hop.end <= node.end:
        pass  # draining, moved or reloading: out of routing until it announces again
    elif node.room() < _charge(node, session, hop):  # full: a capacity refusal, never a ban
        session.gateway.refusals.refuse(node.peer_id, session.request.max_length)
        session.gateway.meter.short_of_room(world.clock.now)
    else:
        return True
    avoid.add(node.peer_id)
    return False


def _charge(node: SimNode, session: Session, hop: Hop) -> int:
    """The pool tokens the hop's node charges the session (``shared.kv_charge``: its blocks' share)."""
    return pool_tokens(session.request.max_length, hop.end - hop.start, node.span)


def _opened(world: World, session: Session, hops: list[Hop]) -> None:
    for hop in hops:
        node = world.nodes[hop.peer_id]
        node.reserved += _charge(node, session, hop)
        node.sessions.add(session.index)
        session.gateway.load[hop.peer_id] += 1
        session.gateway.bans.record_success(hop.peer_id)
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
        session.gateway.bans.record_failure(node.peer_id)
    hop = lost[0]
    deadline = world.clock.now + DEFAULT_FAILOVER_WAIT
    delay = CRASH_NOTICED if fault else 0.0
    world.clock.after(delay, lambda: _open(world, session, hop.start, hop.end, deadline))


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
    _release(world, session, session.hops)
    session.hops = []
    world.chains_changed(session)


def _release(world: World, session: Session, hops: list[Hop]) -> None:
    for hop in hops:
        node = world.nodes[hop.peer_id]
        if session.index in node.sessions:
            node.sessions.discard(session.index)
            node.reserved -= _charge(node, session, hop)
        session.gateway.load[hop.peer_id] -= 1
        if session.gateway.load[hop.peer_id] <= 0:
            del session.gateway.load[hop.peer_id]
