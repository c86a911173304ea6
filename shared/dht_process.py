"""Starting hivemind's DHT so that it never outlives the process that started it.

hivemind runs the DHT in a child process (with its own p2pd daemon). If the parent is SIGKILLed or crashes, that
child would linger forever, still a member of the swarm. A watchdog coroutine inside the child polls its parent
and, once the parent is gone, shuts the DHT node down (which stops p2pd) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from shared.identity import PeerIdentity, register_identity

PARENT_POLL_SECONDS = 1.0


def start_dht(
    *, identity: PeerIdentity | None = None, daemon_flags: Mapping[str, Any] | None = None, **kwargs: Any
) -> DHT:
    """``identity``: the key p2pd takes as the peer's identity, the same that signs its records (``dht_kwargs``).

    ``daemon_flags``: p2pd command-line flags hivemind's ``P2P.create`` has no parameter for (the relay service's
    limits: ``relayService``, ``relayMaxCircuits``, ...).
    """
    with _extra_daemon_flags(daemon_flags or {}):
        if identity is None:
            dht = DHT(start=True, **kwargs)
        else:
            # A key generated just now is nobody else's: skip hivemind's probe of the swarm for a peer using it.
            probe = {} if identity.path else {"check_if_identity_free": False}
            with identity.key_file() as path:  # p2pd has read it once the DHT is up; a temporary file goes then
                dht = DHT(start=True, identity_path=path, **probe, **kwargs)
    if identity is not None:
        if dht.peer_id.to_base58() != identity.peer_id:
            dht.shutdown()
            raise RuntimeError(f"p2pd took the peer id {dht.peer_id}, not {identity.peer_id} of its identity key")
        register_identity(identity)
    dht.run_coroutine(partial(_exit_with_parent, parent=os.getpid()), return_future=True)
    return dht


async def _exit_with_parent(dht: DHT, node: DHTNode, *, parent: int) -> None:
    while os.getppid() == parent:  # noqa: ASYNC110 - no event announces a parent's death; polling is the way
        await asyncio.sleep(PARENT_POLL_SECONDS)
    try:
        await asyncio.wait_for(node.shutdown(), timeout=5)
    finally:
        os._exit(0)


@contextlib.contextmanager
def _extra_daemon_flags(flags: Mapping[str, Any]) -> Iterator[None]:
    """While a DHT starts, p2pd is launched with ``flags`` too.

    hivemind builds p2pd's command line in ``P2P._make_process_args`` and exposes no way to add to it; the DHT's
    child process is forked inside ``DHT(start=True)``, so it inherits the wrapper installed here, and the parent
    restores hivemind's own right after.
    """
    if not flags:
        yield
        return
    original = P2P._make_process_args

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        made: list[str] = original(*args, **{**kwargs, **flags})
        return made

    P2P._make_process_args = staticmethod(with_flags)
    try:
        yield
    finally:
        P2P._make_process_args = staticmethod(original)
