"""What the nodes of a local swarm report about themselves (their info RPC): open sessions and free cache room."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hivemind.p2p import P2P

from shared.rpc_client import fetch_info
from shared.wire import NodeInfo
from tests.helpers.processes import LocalSwarm


async def node_infos(p2p: P2P, swarm: LocalSwarm) -> list[NodeInfo]:
    peers = [node.peer_id for node in swarm.serving_nodes()]
    return [(await fetch_info(p2p, peer, 10.0))[0] for peer in peers]


async def wait_infos(
    p2p: P2P, swarm: LocalSwarm, holds: Callable[[NodeInfo], bool], within: float, every: float = 0.1
) -> list[NodeInfo]:
    """Until ``holds`` is true of every node's info (or ``within`` seconds); returns the last infos either way."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        infos = await node_infos(p2p, swarm)
        if all(holds(i) for i in infos) or asyncio.get_running_loop().time() > deadline:
            return infos
        await asyncio.sleep(every)


async def wait_all_free(p2p: P2P, swarm: LocalSwarm, within: float = 15.0) -> list[NodeInfo]:
    """Until no node holds a session or cache room (or ``within`` seconds); returns the last infos either way."""
    return await wait_infos(
        p2p, swarm, lambda i: i.sessions == 0 and i.cache_tokens_left == i.cache_tokens_total, within
    )


async def wait_each_holding(p2p: P2P, swarm: LocalSwarm, sessions: int, within: float = 10.0) -> list[NodeInfo]:
    """Until every node reports ``sessions`` live allocations (or ``within`` seconds); returns the last infos either
    way. A node counts a stateless forward in flight as one (the gateway's spot checks send some, re-running a
    served step on the node itself when it has no replica), so a count read once can be one high for a moment."""
    return await wait_infos(p2p, swarm, lambda i: i.sessions == sessions, within, every=0.05)
