"""The engine's kept conversations: open ``ChainSession``s parked in a ``ConversationPool`` between a chat's turns.

A chain is parked when its generation ended well: its nodes' room is shrunk to the tokens they hold (in the
background — the client has its answer already), and it waits for the next turn of its scope. It is closed — its
nodes' room freed — when it expires, is evicted, one of its nodes stops serving, or the engine closes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gateway.swarm.chain_session import ChainSession
from gateway.swarm.conversations import ConversationPool, Taken
from gateway.swarm.view import SwarmView
from shared.background import Periodic

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parked:
    chain: ChainSession
    shrunk: asyncio.Task[None]  # the shrink to the held tokens; a chain it failed to shrink is closed


class KeptChains:
    def __init__(self, view: Callable[[], Awaitable[SwarmView]], keep_alive: float, max_kept: int) -> None:
        self.pool: ConversationPool[Parked] = ConversationPool(keep_alive, max_kept)
        self._view = view
        period = min(max(self.pool.keep_alive / 4, 0.05), 5.0)
        self._sweeper = Periodic("kept-conversations", period, self.sweep)
        self._closed = False

    def start(self) -> None:
        if self.pool.enabled:
            self._sweeper.start()

    async def close(self) -> None:
        self._closed = True  # a generation ending after this closes its chain instead of parking it
        await self._sweeper.stop()
        await self._discard(self.pool.clear())

    def take(self, scope: str, prompt_ids: Sequence[int]) -> Taken[Parked] | None:
        return self.pool.take(scope, prompt_ids)

    async def keep(self, scope: str, token_ids: Sequence[int], chain: ChainSession) -> None:
        """Park ``chain``, whose nodes hold ``token_ids``, for the scope's next turn (or close it if none is kept)."""
        if self._closed or not self.pool.enabled:
            await chain.close()
            return
        parked = Parked(chain, asyncio.create_task(_shrink(chain, len(token_ids))))
        await self._discard(self.pool.keep(scope, token_ids, parked))

    async def sweep(self) -> None:
        """Close the expired chains, and those through a node no longer online."""
        await self._discard(self.pool.expired())
        if not len(self.pool):
            return
        try:
            online = {server.peer_id for server in (await self._view()).online()}
        except Exception:
            logger.warning("cannot check the nodes of kept conversations", exc_info=True)
            return
        # A draining node waits for its sessions to end: free it now rather than at expiry.
        await self._discard(self.pool.remove_if(functools.partial(_left, online)))

    async def _discard(self, parked: list[Parked]) -> None:
        for item in parked:
            item.shrunk.cancel()
        await asyncio.gather(*(item.shrunk for item in parked), return_exceptions=True)
        await asyncio.gather(*(item.chain.close() for item in parked), return_exceptions=True)


def _left(online: set[str], parked: Parked) -> bool:
    """Whether a node of the parked chain is no longer online (draining, gone)."""
    return any(hop.peer_id not in online for hop in parked.chain.hops)


async def _shrink(chain: ChainSession, tokens: int) -> None:
    if chain.max_length == tokens:
        return
    try:
        await chain.resize(tokens)
    except Exception as error:
        logger.info("closing a kept conversation that could not shrink: %s", error)
        await chain.close()
