"""The simulator: reproducible for a seed, driven by the real plan_route, and a quick scenario end to end."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gateway.swarm import routing
from gateway.swarm.recovery import ROOM_WAIT, WAIT_POLL
from gateway.swarm.routing import Hop, RouteRequest, RoutingMode
from gateway.swarm.view import SwarmView
from shared.server_records import NodeState
from sim import clients, dataflow, lifecycle, report
from sim.clients import CRASH_NOTICED
from sim.dataflow import bound
from sim.hardware import LLAMA_70B
from sim.route_plan import path_lp
from sim.route_plan.chains import Chain
from sim.scenario import Result, Scenario, run, settle
from sim.workload import Request, mean_request
from sim.world import Session

SMALL = replace(Scenario("small", model=LLAMA_70B, nodes=30).quick(), duration=200.0, measure_from=150.0)


def fingerprint(result: Result) -> tuple[object, ...]:
    m = result.metrics
    return (tuple(m.throughput), tuple(m.bound), m.finished, m.refused, m.failovers, m.moves)


def test_a_seed_gives_the_same_run_and_another_seed_another() -> None:
    first, again = run(SMALL), run(SMALL)
    assert fingerprint(first) == fingerprint(again)
    assert sum(first.metrics.throughput) > 0
    assert fingerprint(run(replace(SMALL, seed=2))) != fingerprint(first)


def test_the_simulator_routes_with_the_real_plan_route(monkeypatch: pytest.MonkeyPatch) -> None:
    baseline = run(SMALL)
    calls: list[int] = []
    real = routing.plan_route

    def longest_hops_first(view: SwarmView, request: RouteRequest, mode: RoutingMode) -> list[Hop]:
        calls.append(1)
        return real(view, request, RoutingMode.MAX_THROUGHPUT)  # a different policy: a different swarm

    monkeypatch.setattr("sim.world.plan_route", longest_hops_first)
    changed = run(SMALL)
    assert len(calls) == len(changed.route_times) > 0
    assert fingerprint(changed) != fingerprint(baseline)


def test_a_quick_scenario_with_nodes_leaving_end_to_end(tmp_path: Path) -> None:
    result = run(replace(SMALL, name="leave", event="leave", event_at=170.0))
    summary = result.summary
    assert summary["throughput"] > 0 and 0 < summary["ratio"] <= 1.0
    # The path LP's bound, over the steady window, is never above the per-node relaxation it tightens.
    assert 0 < summary["bound"] <= summary["node_bound"] * (1 + 1e-9) and summary["ratio"] >= summary["node_ratio"]
    assert summary["failovers"] > 0  # the crashed nodes' sessions moved
    assert "recovered_after" in summary
    # Recovery is judged against the path LP too, computed after the event: never above the per-node bound, so
    # ours is no further from it than from the per-node one.
    m = result.metrics
    after = [(p, b) for t, p, b in zip(m.times, m.path_bound, m.bound, strict=True) if t >= 170.0]
    assert after and all(0 <= p <= b * (1 + 1e-9) for p, b in after)
    assert summary["worst_ratio_after"] >= summary["node_worst_ratio_after"]
    assert summary["recovered_after"] <= summary["node_recovered_after"]
    path = report.write([result], {30: (result.route_times, result.route_times)}, tmp_path, "test")
    text = path.read_text()
    assert "| leave | 30 |" in text and "(per-node: back >80 %" in text
    assert "Route choice" in text and "DHT traffic" in text
    assert (tmp_path / "sim-leave-30.png").stat().st_size > 0


def test_the_bounds_count_draining_nodes_that_still_decode() -> None:
    # A node moving or leaving gracefully decodes its open sessions until its drain deadline: a bound without it
    # fell below ours after an event (many nodes drain then).
    world = settle(replace(SMALL, churn=False), 150.0)
    _, held = mean_request()
    before = bound(world, held)
    node = world.serving()[0]
    node.state = NodeState.DRAINING
    assert node not in world.carrying()  # no sessions: it decodes nothing until it is back
    node.sessions[0] += 1
    assert node in world.carrying() and bound(world, held) == before
    node.gone = True
    assert node not in world.carrying()


def test_a_session_waits_the_gateways_failover_wait_for_a_range_whose_every_server_crashed() -> None:
    # The gateway waits --failover-wait (120 s) for a node to serve a lost range again. The simulator gave up after
    # 30 s: where a fifth of the nodes left and took every server of blocks 75-76 with them (seed 2), every session
    # of the swarm was lost while a node moved there.
    world = settle(replace(SMALL, churn=False), 150.0)
    clients.arrive(world, world.gateways[0], Request(prompt=64, output=4000))
    session = world.sessions[0]
    world.clock.run_until(160.0)
    assert session.decoding
    block = session.hops[0].start
    servers = [n for n in world.serving() if n.start <= block < n.end]
    for node in servers:
        lifecycle.leave(world, node, crash=True)
    assert not world.complete(session)
    # A volunteer restarts after its record and the others' have expired: it joins where the swarm has the gap.
    back = world.new_node(servers[0].hw, servers[0].city, servers[0].last_mile)
    world.clock.at(190.0, lambda: lifecycle.join(world, back))
    world.clock.run_until(160.0 + 110.0)
    assert session.decoding and world.complete(session) and not session.lost and session.failovers >= 1


def test_a_lost_range_is_routed_again_within_a_poll_of_a_node_serving_it_as_the_gateway_reads_the_dht() -> None:
    # The gateway's failover reads the DHT again every WAIT_POLL while no node serves a lost range; the simulator
    # looked every RETRY_AFTER (10 s), on a view up to 10 s old, so a whole chain sat idle that long after the gap
    # closed.
    world = settle(replace(SMALL, churn=False, balancing=False), 150.0)
    clients.arrive(world, world.gateways[0], Request(prompt=64, output=4000))
    session = world.sessions[0]
    world.clock.run_until(160.0)
    block = session.hops[0].start
    servers = [n for n in world.serving() if n.start <= block < n.end]
    for node in servers:
        lifecycle.leave(world, node, crash=True)
    back = world.new_node(servers[0].hw, servers[0].city, servers[0].last_mile)
    world.clock.at(190.0, lambda: lifecycle.join(world, back))
    while back.state is not NodeState.ONLINE:
        world.clock.run_until(world.clock.now + 0.25)
    assert back.start <= block < back.end and not world.complete(session)
    world.clock.run_until(world.clock.now + WAIT_POLL + 1.0)  # a look at a fresh view, then the prefill
    assert world.complete(session) and session.decoding


def test_a_node_holding_two_hops_of_a_session_frees_both_and_both_ranges_open_again_when_it_dies() -> None:
    # Two failovers can put two hops of one chain on one node (the gateway holds two node sessions there). The
    # simulator released the first hop's room only, and routed only the first hop's range again: the session never
    # decoded again.
    world = settle(replace(SMALL, churn=False, balancing=False), 150.0)
    clients.arrive(world, world.gateways[0], Request(prompt=64, output=4000))
    session = world.sessions[0]
    world.clock.run_until(160.0)
    hop = next(h for h in session.hops if h.end - h.start >= 2)
    node = world.nodes[hop.peer_id]
    clients._release(world, session, [hop])
    base = node.reserved
    halves = [Hop(hop.peer_id, hop.start, hop.start + 1), Hop(hop.peer_id, hop.start + 1, hop.end)]
    for half in halves:
        clients._hold(world, session, half)
        session.held.remove(half)
    session.hops = sorted([h for h in session.hops if h != hop] + halves, key=lambda h: h.start)
    world.chains_changed(session)
    assert node.sessions[session.index] == 2
    lifecycle.leave(world, node, crash=True)
    assert node.reserved == base and session.index not in node.sessions
    world.clock.run_until(world.clock.now + 30.0)
    assert world.complete(session) and session.decoding and not session.lost
    assert all(h.peer_id != node.peer_id for h in session.hops)


def test_a_node_found_dead_is_out_of_the_gateways_view_while_its_record_lingers() -> None:
    # As the gateway's router (Recovery.GONE: departures): the simulator banned it, and a ban gives way where every
    # other server of a block is banned or busy, so a failover dialled the dead node again every poll.
    world = settle(replace(SMALL, churn=False, balancing=False), 150.0)
    clients.arrive(world, world.gateways[0], Request(prompt=64, output=4000))
    session = world.sessions[0]
    world.clock.run_until(160.0)
    dead = world.nodes[session.hops[0].peer_id]
    lifecycle.leave(world, dead, crash=True)
    world.clock.run_until(world.clock.now + CRASH_NOTICED + 1.0)
    assert dead.peer_id in world.dht.view(world.clock.now).servers  # its record has not expired
    assert dead.peer_id not in session.gateway.view(fresh=True).servers


def test_a_failover_refused_room_after_a_wait_lets_go_of_its_chain_and_opens_it_again_whole() -> None:
    # As the gateway's failover.ChainReopened: mid-stream, a chain held its other nodes while it waited for room;
    # after "Europe goes dark" (seed 3) 383 chains did so on nodes full of chains waiting on others, for the whole
    # failover wait, and were all lost.
    world = settle(replace(SMALL, churn=False, balancing=False), 150.0)
    clients.arrive(world, world.gateways[0], Request(prompt=64, output=4000))
    session = world.sessions[0]
    world.clock.run_until(160.0)
    assert session.decoding and len(session.hops) > 1
    fillers = []
    for node in world.serving():  # every pool full, the session's own nodes too
        room = Request(prompt=1, output=node.room() - 1)
        filler = Session(10_000 + node.index, world.gateways[0], room, world.clock.now)
        world.sessions[filler.index] = filler
        clients._hold(world, filler, Hop(node.peer_id, node.start, node.end))
        fillers.append(filler)
    lost = world.nodes[session.hops[-1].peer_id]
    lifecycle.leave(world, lost, crash=True)
    world.clock.run_until(world.clock.now + CRASH_NOTICED + ROOM_WAIT + 2 * WAIT_POLL)
    assert not session.lost and not session.hops and not session.held  # let go while it waits
    assert all(session.index not in node.sessions for node in world.nodes.values())
    for filler in fillers:
        clients._release(world, filler, filler.held)
    world.clock.run_until(world.clock.now + ROOM_WAIT + 5.0)
    assert session.decoding and world.complete(session) and not session.lost


def test_a_new_session_holds_no_room_while_it_waits_and_a_full_node_takes_it_the_moment_room_frees() -> None:
    """As ``gateway.swarm.failover.reopen`` opens a new chain some of whose nodes are full: it lets go of the nodes
    that took it and waits on a full one, which takes it as soon as a session there ends (``RETRY_AFTER`` later before
    stop 45: room sat unused meanwhile)."""
    world = settle(replace(SMALL, churn=False, balancing=False), 150.0)
    fillers = []
    for node in world.serving():
        if node.start > 0:  # every node but those of block 0 full, each with one session of its whole room
            room = Request(prompt=1, output=node.room() - 1)  # max_length: the node's room
            filler = Session(10_000 + node.index, world.gateways[0], room, world.clock.now)
            world.sessions[filler.index] = filler
            clients._hold(world, filler, Hop(node.peer_id, node.start, node.end))
            assert node.room() == 0
            fillers.append(filler)
    arrived = world.clock.now
    clients.arrive(world, world.gateways[0], Request(prompt=64, output=400))
    session = next(s for s in world.sessions.values() if s.index < 10_000)
    world.clock.run_until(arrived + 11.5)  # its second wait on a full node began at 11 s (ROOM_WAIT + WAIT_POLL)
    assert not session.held and not session.hops and not session.lost
    assert all(session.index not in node.sessions for node in world.serving())  # block 0's nodes had room: let go
    for filler in fillers:
        clients._release(world, filler, filler.held)  # its session ended: the node's room wait wakes
    world.clock.run_until(arrived + 16.0)  # the next look without the node's wait: 21 s (RETRY_AFTER's: 20 s)
    assert session.decoding and world.complete(session)


def test_a_new_session_waits_for_room_as_the_gateway_does_and_is_refused_at_once_where_a_block_has_no_server() -> None:
    world = settle(replace(SMALL, churn=False, balancing=False), 150.0)
    full = {node: node.reserved for node in world.serving()}
    for node in full:
        node.reserved = node.hw.cache_tokens  # every pool full: an open is refused for room (a capacity answer)
    clients.arrive(world, world.gateways[0], Request(prompt=64, output=400))
    session = world.sessions[0]
    world.clock.run_until(150.0 + 60.0)  # the gateway's failover waits for room up to 120 s (30 s here before)
    assert not session.decoding and not session.lost and world.metrics.refused == 0
    for node, reserved in full.items():
        node.reserved = reserved
    world.clock.run_until(150.0 + 100.0)
    assert session.decoding and world.complete(session) and not session.lost

    for node in [n for n in world.serving() if n.start == 0]:
        lifecycle.leave(world, node, crash=True)
    world.clock.run_until(world.clock.now + 30.0)  # their records expired: the view has no server of block 0
    clients.arrive(world, world.gateways[0], Request(prompt=64, output=400))
    assert world.sessions[1].lost and world.metrics.refused == 1  # missing_blocks, at once


def test_the_path_bound_starts_from_the_chains_sessions_decode_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 1,000 nodes the fastest chains leave most nodes out of the first restricted LP, and the bound stayed open
    for a whole run; the chains sessions decode on put every node they use in it from the first call."""
    world = settle(replace(SMALL, churn=False, balancing=False), 150.0)
    for gateway in world.gateways:
        for _ in range(3):
            clients.arrive(world, gateway, Request(prompt=64, output=400))
    world.clock.run_until(world.clock.now + 5.0)
    decoding = [world.sessions[i] for i in sorted(world.decoding)]
    assert len({id(s.gateway) for s in decoding}) == len(world.gateways) > 1
    given: list[tuple[Chain, ...]] = []

    def seen(*args: object, start: tuple[Chain, ...] = (), **kwargs: object) -> object:
        given.append(start)
        return path_lp.path_bound(*args, start=start, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dataflow, "path_bound", seen)
    _, held = mean_request()
    found = dataflow.path(world, held)
    row = {n.peer_id: i for i, n in enumerate(n for n in world.carrying() if n.capacity > 0 and n.hw.cache_tokens > 0)}
    for session in decoding:
        gateway = world.gateways.index(session.gateway)
        chain = Chain(gateway, tuple((row[hop.peer_id], hop.start) for hop in session.hops))
        assert chain in given[0]
    assert found is not None and found.closed


def test_a_new_session_waits_on_a_node_that_announces_no_room_instead_of_asking_each_such_node_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the gateway's failover (``routing.short_of_room``): a route that must take nodes whose records say they
    are full asks them to hold the open until they have room. Asked without a wait, each refused and the next route
    took the next full node: four in five routes of a full 100-node swarm (stop 53)."""
    world = settle(replace(SMALL, churn=False, balancing=False), 150.0)
    fillers = []
    for node in world.serving():
        if node.start > 0:  # every node but those of block 0 full, and announcing so
            filler = Session(10_000 + node.index, world.gateways[0], Request(prompt=1, output=node.room() - 1), 150.0)
            world.sessions[filler.index] = filler
            clients._hold(world, filler, Hop(node.peer_id, node.start, node.end))
            world.dht.announce(node, world.clock.now)
            fillers.append(filler)
    gateway = world.gateways[0]
    gateway.view(fresh=True)
    routes = []
    route = gateway.route
    monkeypatch.setattr(gateway, "route", lambda *args, **kw: routes.append(args[1:3]) or route(*args, **kw))
    clients.arrive(world, gateway, Request(prompt=64, output=400))
    session = next(s for s in world.sessions.values() if s.index < 10_000)
    world.clock.run_until(world.clock.now + 1.0)
    assert len(routes) == 2, routes  # its route, then the whole chain again past the nodes that refused it
    for filler in fillers:
        clients._release(world, filler, filler.held)  # room frees: the node it waits on takes it
    world.clock.run_until(world.clock.now + 5.0)
    assert session.decoding and world.complete(session) and len(routes) == 2
