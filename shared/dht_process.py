"""Starting hivemind's DHT so that it never outlives the process that started it.

hivemind runs the DHT in a child process (with its own p2pd daemon). If the parent is SIGKILLed or crashes, that
child would linger forever, still a member of the swarm. A watchdog coroutine inside the child polls its parent
and, once the parent is gone, shuts the DHT node down (which stops p2pd) and exits.
"""

from __future__ import annotations

import asyncio
import os
from functools import partial
from typing import Any

from hivemind import DHT
from hivemind.dht.node import DHTNode

PARENT_POLL_SECONDS = 1.0


def start_dht(**kwargs: Any) -> DHT:
    dht = DHT(start=True, **kwargs)
    dht.run_coroutine(partial(_exit_with_parent, parent=os.getpid()), return_future=True)
    return dht


async def _exit_with_parent(dht: DHT, node: DHTNode, *, parent: int) -> None:
    while os.getppid() == parent:  # noqa: ASYNC110 - no event announces a parent's death; polling is the way
        await asyncio.sleep(PARENT_POLL_SECONDS)
    try:
        await asyncio.wait_for(node.shutdown(), timeout=5)
    finally:
        os._exit(0)
