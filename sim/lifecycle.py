"""Node events: join, come online, announce, rebalance (drain, reload), leave gracefully or crash."""

from __future__ import annotations

from collections.abc import Callable

from shared.server_records import NodeState
from sim import clients
from sim.swarm import ANNOUNCE_PERIOD, BALANCE_PERIOD, DRAIN_TIMEOUT, SimNode, balance_move, join_start
from sim.world import World
from swarm_node.span_choice import GAP_CHECK_PERIOD, fills_a_gap

DRAIN_POLL = 1.0  # seconds between a draining node's looks at its open sessions


def join(world: World, node: SimNode) -> None:
    node.start = join_start(world.dht, node, world.clock.now)
    node.end = node.start + node.span
    node.state = NodeState.JOINING
    world.dht.announce(node, world.clock.now)
    world.clock.after(node.hw.load_time, lambda: _online(world, node, first=True))


def _online(world: World, node: SimNode, first: bool) -> None:
    if node.gone:
        return
    node.state = NodeState.ONLINE
    node.moving_to = None
    world.dht.announce(node, world.clock.now)
    if first:
        phase = float(world.rng.uniform(0, 1))
        world.clock.after(phase * ANNOUNCE_PERIOD, lambda: _announce_forever(world, node))
        world.clock.after(phase * BALANCE_PERIOD + BALANCE_PERIOD, lambda: _balance_forever(world, node))


def _announce_forever(world: World, node: SimNode) -> None:
    if node.gone:
        return
    world.dht.announce(node, world.clock.now)
    world.clock.after(ANNOUNCE_PERIOD, lambda: _announce_forever(world, node))


def _balance_forever(world: World, node: SimNode) -> None:
    if node.gone:
        return
    if node.state is NodeState.ONLINE and world.balancing:
        new_start = balance_move(world.dht, node, world.clock.now)
        if new_start is not None:
            _move(world, node, new_start)
    world.clock.after(BALANCE_PERIOD, lambda: _balance_forever(world, node))


def _move(world: World, node: SimNode, new_start: int) -> None:
    """Drain (only while the new span holds no block nobody serves: ``swarm_node.server``'s move does the same),
    load the new span, come online."""
    world.metrics.moves += 1
    node.moves += 1
    node.state = NodeState.DRAINING
    node.moving_to = new_start
    world.dht.announce(node, world.clock.now)

    def reload() -> None:
        node.start, node.end = new_start, new_start + node.span
        world.clock.after(node.hw.load_time, lambda: _online(world, node, first=False))

    checked = world.clock.now - GAP_CHECK_PERIOD  # the first check on the records the move was chosen from

    def gap() -> bool:
        nonlocal checked
        if world.clock.now - checked < GAP_CHECK_PERIOD:
            return False
        checked = world.clock.now
        return fills_a_gap(world.dht.servers(world.clock.now).values(), new_start, node.span, world.model.num_blocks)

    _drain(world, node, world.clock.now + DRAIN_TIMEOUT, reload, gap)


def _drain(
    world: World, node: SimNode, deadline: float, then: Callable[[], None], stop: Callable[[], bool] = lambda: False
) -> None:
    """Let open sessions finish; at the deadline, or once ``stop`` says so, the rest fail over (not a fault: no
    ban)."""
    if node.gone:
        return
    if node.sessions and world.clock.now < deadline and not stop():
        world.clock.after(DRAIN_POLL, lambda: _drain(world, node, deadline, then, stop))
        return
    for index in sorted(node.sessions):
        clients.fail_over(world, world.sessions[index], node, fault=False)
    then()


def leave(world: World, node: SimNode, crash: bool) -> None:
    if node.gone:
        return
    if crash:
        node.gone = True  # its record stays in the DHT until it expires
        for index in sorted(node.sessions):
            clients.fail_over(world, world.sessions[index], node, fault=True)
        return
    node.state = NodeState.DRAINING
    node.moving_to = None  # leaving, not moving
    world.dht.announce(node, world.clock.now)

    def gone() -> None:
        node.state = NodeState.OFFLINE
        world.dht.announce(node, world.clock.now)
        node.gone = True

    _drain(world, node, world.clock.now + DRAIN_TIMEOUT, gone)
