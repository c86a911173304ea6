"""Where a node serves: pure functions over the swarm's announced servers.

The swarm's strength at a block is the sum of the decode throughputs of the live servers covering it; the swarm is
as fast as its weakest block. A new node takes the window of ``num_blocks`` where the swarm is weakest; a serving
node moves when moving would raise the swarm's minimum by more than the balance-quality threshold, and never when
its leaving would uncover a block.

A node moving announces where to (``ServerRecord.moving_to``) while it drains and loads, and is counted there: the
simulator found that without it, after a fifth of a 100-node swarm left at once, the nodes checking in the next
minute or two all saw the same weakest window, 20 of them moved onto blocks 74:79 within 17 s, and 35 (many of the
same) moved on to the gap they had left a minute later (``bench/README.md``).
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.server_records import NodeState, ServerRecord

LIVE_STATES = (NodeState.JOINING, NodeState.ONLINE)
# While a move drains, how often the node reads the DHT for a block of its new span that nobody serves any more
# (``fills_a_gap``: then it stops waiting for its sessions); the simulator checks as often.
GAP_CHECK_PERIOD = 5.0


def block_throughputs(
    servers: Iterable[ServerRecord], num_blocks: int, exclude: str | None = None, moving: bool = True
) -> list[float]:
    """Per block: summed throughput of the live servers covering it (``exclude``: a peer to leave out), and with
    ``moving`` of the draining servers moving onto it (``ServerRecord.moving_to``), as they will be.

    A node still loading announces no throughput yet (it measures it once loaded); it counts as the median of the
    measured ones (1.0 when none is), so nodes joining together do not all see its span as empty and pile onto
    one window — the simulator found 40 nodes joining within a minute all on blocks 0:10 of 126.
    """
    servers = [s for s in servers if s.peer_id != exclude]
    live = [s for s in servers if s.state in LIVE_STATES]
    measured = sorted(s.throughput for s in live if s.throughput > 0)
    unmeasured = measured[len(measured) // 2] if measured else 1.0
    spans = [(s, s.start) for s in live]
    if moving:
        spans += [(s, s.moving_to) for s in servers if s.state is NodeState.DRAINING and s.moving_to is not None]
    totals = [0.0] * num_blocks
    for server, start in spans:
        for block in range(start, min(start + server.end - server.start, num_blocks)):
            totals[block] += server.throughput or unmeasured
    return totals


def choose_start(throughputs: list[float], num_blocks: int) -> int:
    """Start of the window of ``num_blocks`` blocks that is weakest: lowest minimum, then lowest sum, then first."""
    if not 0 < num_blocks <= len(throughputs):
        raise ValueError(f"cannot place {num_blocks} blocks in a model of {len(throughputs)}")
    starts = range(len(throughputs) - num_blocks + 1)
    return min(starts, key=lambda s: (min(throughputs[s : s + num_blocks]), sum(throughputs[s : s + num_blocks]), s))


def fills_a_gap(servers: Iterable[ServerRecord], start: int, num_blocks: int, num_model_blocks: int) -> bool:
    """Whether blocks [start, start + num_blocks) hold one that no live server covers. While one does, no session
    of the swarm can go on (every chain runs every block), so a node moving there need not drain its own first."""
    serving = block_throughputs(servers, num_model_blocks, moving=False)
    return any(serving[block] <= 0 for block in range(start, min(start + num_blocks, num_model_blocks)))


def swarm_minimum_after_joining(throughputs: list[float], start: int, num_blocks: int, throughput: float) -> float:
    joined = list(throughputs)
    for block in range(start, start + num_blocks):
        joined[block] += throughput
    return min(joined)


def choose_new_start(
    servers: Iterable[ServerRecord], me: ServerRecord, num_model_blocks: int, balance_quality: float
) -> int | None:
    """Where ``me`` should move, or None to stay.

    Moves only if the swarm's minimum throughput after the move exceeds today's by the threshold
    (``current < balance_quality * after``), and never if some block of ``me`` has no other live server (one only
    moving there does not count: it serves nothing until it has loaded).
    """
    servers = list(servers)
    num_blocks = me.end - me.start
    serving = block_throughputs(servers, num_model_blocks, exclude=me.peer_id, moving=False)
    if any(serving[block] <= 0 for block in range(me.start, me.end)):
        return None  # leaving would uncover a block
    without_me = block_throughputs(servers, num_model_blocks, exclude=me.peer_id)
    current = min(block_throughputs(servers, num_model_blocks))
    start = choose_start(without_me, num_blocks)
    if start == me.start:
        return None
    after = swarm_minimum_after_joining(without_me, start, num_blocks, me.throughput)
    return start if current < balance_quality * after else None
