"""Route choice and bans on synthetic swarms (pure functions, no processes)."""

from __future__ import annotations

import pytest

from gateway.swarm.bans import BanList
from gateway.swarm.routing import Hop, RouteRequest, RoutingMode, hop_cost, plan_route
from gateway.swarm.view import SwarmView
from shared.dht_records import NodeState, ServerRecord
from shared.errors import MissingBlocks

MIN_LATENCY, MAX_THROUGHPUT = RoutingMode.MIN_LATENCY, RoutingMode.MAX_THROUGHPUT


def server(
    peer: str,
    start: int,
    end: int,
    *,
    throughput: float = 20.0,
    cache: int = 10_000,
    pool: int = 0,
    queue: int = 0,
    state: NodeState = NodeState.ONLINE,
    adapters: tuple[str, ...] = (),
    next_rtts: dict[str, float] | None = None,
) -> ServerRecord:
    return ServerRecord(
        adapters=list(adapters),
        next_rtts=next_rtts or {},
        peer_id=peer,
        start=start,
        end=end,
        state=state,
        throughput=throughput,
        cache_tokens_left=cache,
        cache_tokens_total=pool,
        queue_depth=queue,
        version="test",
        protocol=1,
    )


def view(*servers: ServerRecord, blocks: int = 30) -> SwarmView:
    return SwarmView(blocks, {s.peer_id: s for s in servers})


def test_split_coverage_gives_a_two_hop_chain() -> None:
    swarm = view(server("A", 0, 15), server("B", 15, 30))
    for mode in RoutingMode:
        assert plan_route(swarm, RouteRequest(64), mode) == [Hop("A", 0, 15), Hop("B", 15, 30)]


def test_a_coverage_gap_fails_naming_the_missing_blocks() -> None:
    swarm = view(
        server("A", 0, 10), server("B", 12, 20), server("C", 25, 30), server("D", 20, 25, state=NodeState.DRAINING)
    )
    for mode in RoutingMode:
        with pytest.raises(MissingBlocks, match="10:12, 20:25") as error:
            plan_route(swarm, RouteRequest(64), mode)
        assert error.value.blocks == [10, 11, 20, 21, 22, 23, 24]


def test_min_latency_prefers_the_nearer_replica() -> None:
    swarm = view(server("A", 0, 15), server("far", 15, 30), server("near", 15, 30))
    request = RouteRequest(64, rtts={"A": 0.001, "far": 0.2, "near": 0.002})
    assert plan_route(swarm, request, MIN_LATENCY)[1] == Hop("near", 15, 30)


def test_a_cache_full_nearby_node_loses_to_a_farther_one_with_room() -> None:
    swarm = view(server("A", 0, 15), server("near", 15, 30, cache=10), server("far", 15, 30))
    request = RouteRequest(512, rtts={"A": 0.001, "near": 0.001, "far": 0.3})
    assert plan_route(swarm, request, MIN_LATENCY)[1].peer_id == "far"
    assert plan_route(swarm, request, MAX_THROUGHPUT)[1].peer_id == "far"
    # ...but it still serves when it is the only one.
    alone = view(server("A", 0, 15), server("near", 15, 30, cache=10))
    assert plan_route(alone, request, MIN_LATENCY)[1].peer_id == "near"


def test_min_latency_weighs_compute_against_hops() -> None:
    # One slow node over everything vs two fast halves: the fast chain wins despite the extra hop.
    swarm = view(
        server("slow", 0, 30, throughput=1.0), server("L", 0, 15, throughput=50.0), server("R", 15, 30, throughput=50.0)
    )
    request = RouteRequest(64, rtts={"slow": 0.001, "L": 0.001, "R": 0.001})
    assert [h.peer_id for h in plan_route(swarm, request, MIN_LATENCY)] == ["L", "R"]
    # With fast compute everywhere, one hop beats two.
    swarm = view(
        server("whole", 0, 30, throughput=100.0),
        server("L", 0, 15, throughput=100.0),
        server("R", 15, 30, throughput=100.0),
    )
    request = RouteRequest(64, rtts={"whole": 0.01, "L": 0.01, "R": 0.01})
    assert plan_route(swarm, request, MIN_LATENCY) == [Hop("whole", 0, 30)]


def test_a_busy_nodes_hop_over_part_of_its_span_costs_up_to_its_whole_step() -> None:
    # After A (0:20): B's last 10 of 20 blocks at 0.005 s a block (0.05 s) or C's whole 10 at 1/120 s (0.083 s).
    def swarm(b_left: int) -> SwarmView:
        a = server("A", 0, 20, throughput=50.0)
        b = server("B", 10, 30, throughput=10.0, cache=b_left, pool=10_000)
        return view(a, b, server("C", 20, 30, throughput=12.0))

    request = RouteRequest(64, rtts={"A": 0.001, "B": 0.001, "C": 0.001})
    assert swarm(10_000).servers["B"].occupancy == 0.0
    assert [h.peer_id for h in plan_route(swarm(10_000), request, MIN_LATENCY)] == ["A", "B"]  # idle: 10 blocks
    busy = swarm(1_000)  # 90 % of B's pool in use: (10 + 10 x 0.9) x 0.005 = 0.095 s
    assert busy.servers["B"].occupancy == 0.9
    assert [h.peer_id for h in plan_route(busy, request, MIN_LATENCY)] == ["A", "C"]
    assert hop_cost(busy.servers["B"], 10, request) == pytest.approx(0.001 + 0.095)


def test_min_latency_switches_nodes_only_at_a_span_end() -> None:
    swarm = view(server("A", 0, 20), server("B", 10, 30))
    request = RouteRequest(64, rtts={"A": 0.001, "B": 0.001})
    assert plan_route(swarm, request, MIN_LATENCY) == [Hop("A", 0, 20), Hop("B", 20, 30)]


def test_a_sub_range_route_for_failover() -> None:
    swarm = view(server("A", 0, 15), server("C", 10, 30))
    request = RouteRequest(64, start=15, end=30)
    assert plan_route(swarm, request, MIN_LATENCY) == [Hop("C", 15, 30)]


def test_max_throughput_spreads_sessions_by_load_and_queue() -> None:
    swarm = view(server("A", 0, 15), server("B1", 15, 30), server("B2", 15, 30))
    load: dict[str, int] = {}
    chosen = []
    for _ in range(8):
        hop = plan_route(swarm, RouteRequest(64, load=load), MAX_THROUGHPUT)[1]
        load[hop.peer_id] = load.get(hop.peer_id, 0) + 1
        chosen.append(hop.peer_id)
    assert chosen.count("B1") == 4 and chosen.count("B2") == 4
    # A faster node takes proportionally more; a queued node fewer.
    swarm = view(server("A", 0, 15), server("fast", 15, 30, throughput=60), server("busy", 15, 30, queue=5))
    assert plan_route(swarm, RouteRequest(64), MAX_THROUGHPUT)[1].peer_id == "fast"


def test_banned_nodes_are_avoided_unless_every_server_of_a_block_is_banned() -> None:
    swarm = view(server("A", 0, 15), server("B1", 15, 30), server("B2", 15, 30))
    request = RouteRequest(64, rtts={"A": 0.001, "B1": 0.001, "B2": 0.5}, banned=frozenset({"B1"}))
    assert plan_route(swarm, request, MIN_LATENCY)[1].peer_id == "B2"
    request = RouteRequest(64, banned=frozenset({"A", "B1", "B2"}))
    assert len(plan_route(swarm, request, MIN_LATENCY)) == 2


def test_bans_double_with_consecutive_failures_and_reset_on_success() -> None:
    now = [1000.0]
    bans = BanList(clock=lambda: now[0])
    assert bans.record_failure("X") == 15
    assert bans.banned() == {"X"}
    now[0] += 16
    assert bans.banned() == frozenset()
    assert bans.record_failure("X") == 30
    assert bans.record_failure("X") == 60
    assert bans.status("X").failures == 3 and bans.status("X").banned_for == pytest.approx(60)
    bans.record_success("X")
    assert bans.banned() == frozenset() and bans.record_failure("X") == 15


def test_a_pushing_chain_counts_the_link_between_nodes_not_the_gateways_rtt_to_the_second() -> None:
    # B2 is far from the gateway but next door to A; B1 is nearer the gateway but far from A (as A announced).
    first = server("A", 0, 15).model_copy(update={"next_rtts": {"B1": 0.2, "B2": 0.001}})
    swarm = view(first, server("B1", 15, 30), server("B2", 15, 30))
    rtts = {"A": 0.01, "B1": 0.05, "B2": 0.15}
    assert plan_route(swarm, RouteRequest(64, rtts=rtts), MIN_LATENCY)[1].peer_id == "B1"  # a relay per node
    # Pushed: B1 costs 0.2/2 in + 0.05/2 back; B2 costs 0.001/2 in + 0.15/2 back.
    assert plan_route(swarm, RouteRequest(64, rtts=rtts, push=True), MIN_LATENCY)[1].peer_id == "B2"
    # A link its predecessor never measured costs the gateway's own RTT to the node.
    unmeasured = view(server("A", 0, 15), server("B1", 15, 30), server("B2", 15, 30))
    assert plan_route(unmeasured, RouteRequest(64, rtts=rtts, push=True), MIN_LATENCY)[1].peer_id == "B1"


def test_longest_session_is_the_smallest_over_blocks_of_the_largest_pool_serving_each() -> None:
    # Blocks 0:15 are held by pools of 4000 and 9000 tokens (a session may take the larger); 15:30 by 6000 only.
    swarm = view(server("A", 0, 15, pool=4000), server("B", 0, 15, pool=9000), server("C", 15, 30, pool=6000))
    assert swarm.longest_session() == 6000
    # A draining node's pool holds no new session.
    assert (
        view(server("A", 0, 30, pool=4000), server("B", 0, 30, pool=9000, state=NodeState.DRAINING)).longest_session()
        == 4000
    )
    # Unknown: a block without a node, or only nodes that do not say their pool's size (older nodes).
    assert view(server("A", 0, 15, pool=4000)).longest_session() is None
    assert view(server("A", 0, 15, pool=4000), server("C", 15, 30)).longest_session() is None


@pytest.mark.parametrize("mode", list(RoutingMode))
def test_an_adapters_session_goes_only_through_nodes_that_serve_it(mode: RoutingMode) -> None:
    # The fast full-span node serves no adapter; two slower nodes serve "sql" between them.
    swarm = view(
        server("fast", 0, 30, throughput=100.0),
        server("A", 0, 15, throughput=5.0, adapters=("sql", "chat")),
        server("B", 15, 30, throughput=5.0, adapters=("sql",)),
    )
    assert plan_route(swarm, RouteRequest(10), mode) == [Hop("fast", 0, 30)]
    assert plan_route(swarm, RouteRequest(10, adapter="sql"), mode) == [Hop("A", 0, 15), Hop("B", 15, 30)]
    with pytest.raises(MissingBlocks) as missing:
        plan_route(swarm, RouteRequest(10, adapter="chat"), mode)
    assert missing.value.blocks == list(range(15, 30))
    assert swarm.missing_blocks("chat") == list(range(15, 30)) and swarm.missing_blocks("sql") == []


def test_a_record_without_adapters_is_stored_as_before_adapters() -> None:
    """Older gateways forbid unknown fields: a node serving no adapter must not announce the field."""
    from shared.dht_records import record_json

    assert "adapters" not in record_json(server("A", 0, 30))
    stored = record_json(server("A", 0, 30, adapters=("sql",)))
    assert ServerRecord.model_validate(stored).adapters == ["sql"]


def test_excluded_nodes_are_never_routed_and_reputation_orders_the_rest() -> None:
    view = SwarmView(6, {s.peer_id: s for s in (server("new", 0, 6), server("liar", 0, 6), server("old", 0, 6))})
    request = RouteRequest(16, excluded=frozenset({"liar"}), penalties={"new": 0.25, "old": 0.01})
    for mode in (MIN_LATENCY, MAX_THROUGHPUT):
        assert plan_route(view, request, mode) == [Hop("old", 0, 6)]
    only_liars = RouteRequest(16, excluded=frozenset({"new", "liar", "old"}))
    with pytest.raises(MissingBlocks):  # unlike a ban, never used as a last resort
        plan_route(view, only_liars, MIN_LATENCY)
