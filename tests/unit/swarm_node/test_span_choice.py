"""Span choice on synthetic swarms (pure functions)."""

from __future__ import annotations

import pytest

from shared.dht_records import NodeState, ServerRecord
from shared.server_records import record_json
from swarm_node.span_choice import block_throughputs, choose_new_start, choose_start, fills_a_gap


def server(
    peer: str, start: int, end: int, throughput: float = 10.0, state: NodeState = NodeState.ONLINE
) -> ServerRecord:
    return ServerRecord(
        peer_id=peer, start=start, end=end, state=state, throughput=throughput, version="test", protocol=1
    )


def moving(peer: str, start: int, end: int, to: int, throughput: float = 10.0) -> ServerRecord:
    return server(peer, start, end, throughput, NodeState.DRAINING).model_copy(update={"moving_to": to})


def test_a_new_node_takes_the_uncovered_half() -> None:
    throughputs = block_throughputs([server("A", 0, 15)], 30)
    assert choose_start(throughputs, 15) == 15


def test_a_new_node_takes_the_weakest_window() -> None:
    servers = [
        server("A", 0, 10, 50),
        server("B", 10, 20, 5),
        server("C", 20, 30, 50),
        server("gone", 10, 20, 100, state=NodeState.OFFLINE),
    ]
    assert choose_start(block_throughputs(servers, 30), 10) == 10
    # an empty swarm: the first window
    assert choose_start([0.0] * 30, 15) == 0
    with pytest.raises(ValueError):
        choose_start([0.0] * 30, 31)


def test_a_redundant_node_moves_to_an_uncovered_span() -> None:
    me = server("me", 0, 15)
    servers = [server("A", 0, 15), me, server("B", 15, 20)]
    assert choose_new_start(servers, me, 30, balance_quality=0.75) == 15


def test_a_node_never_moves_if_its_blocks_would_be_uncovered() -> None:
    me = server("me", 0, 15)
    servers = [me, server("B", 15, 30, 1.0)]  # B is weak, but nobody else serves 0:15
    assert choose_new_start(servers, me, 30, balance_quality=0.75) is None


def test_a_node_stays_when_moving_gains_less_than_the_threshold() -> None:
    me = server("me", 0, 15, 10)
    servers = [server("A", 0, 15, 10), me, server("B", 15, 30, 18)]
    # today min = 18 (blocks 15:30); after moving: 0:15 has 10, 15:30 has 28 -> min 10: worse, stay
    assert choose_new_start(servers, me, 30, balance_quality=0.75) is None
    servers = [server("A", 0, 15, 30), me, server("B", 15, 30, 10)]
    # today min = 10; after moving: 0:15 has 30, 15:30 has 20 -> min 20 > 10 / 0.75: move
    assert choose_new_start(servers, me, 30, balance_quality=0.75) == 15
    # a threshold that demands more than a doubling keeps it in place
    assert choose_new_start(servers, me, 30, balance_quality=0.4) is None


def test_nodes_joining_together_spread_over_the_model() -> None:
    # Loading nodes announce no throughput yet: each still counts, so the next joiner takes another window.
    servers: list[ServerRecord] = []
    for i in range(4):
        start = choose_start(block_throughputs(servers, 40), 10)
        servers.append(server(f"J{i}", start, start + 10, throughput=0.0, state=NodeState.JOINING))
    assert sorted(s.start for s in servers) == [0, 10, 20, 30]
    # Beside measured nodes, a loading one counts as their median.
    measured = [server("A", 0, 10, 30.0), server("B", 10, 20, 10.0), server("C", 20, 30, 20.0)]
    loading = server("L", 30, 40, throughput=0.0, state=NodeState.JOINING)
    assert block_throughputs([*measured, loading], 40)[30:] == [20.0] * 10


def test_a_moving_node_counts_where_it_is_going_not_where_it_was() -> None:
    servers = [server("A", 0, 10, 10.0), moving("M", 0, 10, to=20, throughput=5.0)]
    assert block_throughputs(servers, 30) == [10.0] * 10 + [0.0] * 10 + [5.0] * 10
    assert block_throughputs(servers, 30, moving=False) == [10.0] * 10 + [0.0] * 20
    # a draining node that is leaving, not moving, counts nowhere
    assert block_throughputs([server("L", 0, 10, state=NodeState.DRAINING)], 30) == [0.0] * 30


def test_nodes_checking_while_one_moves_do_not_all_follow_it() -> None:
    """The herd the simulator found: after A decides to fill the weak window 20:30 and drains, B (whose check comes
    next) must see A there already and stay, not move onto the same window."""
    a, b = server("A", 0, 10), server("B", 0, 10)
    swarm = [a, b, server("C", 0, 10), server("D", 0, 10), server("E", 10, 20, 40.0), server("F", 20, 30)]
    assert choose_new_start(swarm, a, 30, balance_quality=0.75) == 20
    swarm[0] = moving("A", 0, 10, to=20)
    assert choose_new_start(swarm, b, 30, balance_quality=0.75) is None


def test_a_node_moving_in_does_not_keep_a_block_covered() -> None:
    """Only a serving node covers a block: one still draining elsewhere to come here serves nothing yet."""
    me = server("me", 0, 10)
    swarm = [me, moving("M", 20, 30, to=0), server("X", 10, 20, 1.0), server("Y", 20, 30, 30.0)]
    assert choose_new_start(swarm, me, 30, balance_quality=0.75) is None
    swarm[1] = server("M", 0, 10)  # once it serves there, me may go
    assert choose_new_start(swarm, me, 30, balance_quality=0.75) == 10


def test_a_move_fills_a_gap_only_where_no_serving_node_covers_a_block() -> None:
    swarm = [server("A", 0, 10), server("B", 20, 30), moving("M", 0, 10, to=10)]
    assert fills_a_gap(swarm, 10, 10, 30) and fills_a_gap(swarm, 5, 10, 30)
    assert not fills_a_gap(swarm, 20, 10, 30) and not fills_a_gap(swarm, 0, 10, 30)
    assert not fills_a_gap([*swarm, server("J", 10, 20, 0.0, NodeState.JOINING)], 10, 10, 30)  # loading: covered soon


def test_moving_to_is_announced_only_while_set() -> None:
    """Older readers forbid unknown fields: a record that is not moving must not carry the field."""
    assert "moving_to" not in record_json(server("A", 0, 10))
    assert ServerRecord.model_validate(record_json(moving("A", 0, 10, to=20))).moving_to == 20
