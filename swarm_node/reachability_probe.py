"""A node finds out at start whether peers can dial it, and takes a relay when they cannot.

start DHT (relay service on, if --relay-hop)
  └─ ask an initial peer to dial our listen addresses back (shared.reachability)
       ├─ one answered ............................ DIRECT: serve dial-back checks for others too
       ├─ nobody could be asked ................... DIRECT, assumed (a swarm without our bootstrap peers)
       └─ none answered
            ├─ --no-use-relay ..................... UNREACHABLE: announced so, not counted as coverage
            └─ restart the DHT as a relay client (autorelay on, no relay service), reserve a slot on each
               initial peer ourselves at once (shared.relay_reservation; autorelay, which takes minutes, is the
               fallback), then ask the relay to dial our circuit address until it answers
                 ├─ answered ...................... RELAYED: announce the circuit addresses, renew the slots
                 └─ RELAY_WAIT passed ............. UNREACHABLE
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hivemind import DHT
from hivemind.p2p import P2P

from shared.background import Periodic
from shared.dht_process import replicate_p2p, start_dht, stop_dht, until_dht_lost, visible_maddrs
from shared.reachability import Reachability, ask_dial_back, circuit_addrs, describe, peer_of
from shared.relay_reservation import RelaySlot, reserve_any
from swarm_node.settings import NodeSettings

logger = logging.getLogger(__name__)

RELAY_RETRY = 3.0


@dataclass
class Reach:
    dht: DHT
    verdict: Reachability
    relay_addrs: list[str] = field(default_factory=list)  # where others dial us through a relay (RELAYED only)
    # While the relay path is being checked (a second or two when a relay grants our own reservation; minutes when
    # only p2pd's autorelay gets one), the node loads its weights; ``settled`` waits for the outcome before it goes
    # online.
    pending: asyncio.Task[list[str]] | None = None
    # Jobs renewing our relay slots while the node lives (RELAYED only); the server stops them when it stops.
    renewals: list[Periodic] = field(default_factory=list)

    async def settled(self) -> Reach:
        if self.pending is None:
            return self
        relay_addrs = await self.pending
        if not relay_addrs:
            for job in self.renewals:
                job.cancel()
            return _decided(Reach(self.dht, Reachability.UNREACHABLE))
        return _decided(Reach(self.dht, Reachability.RELAYED, relay_addrs, renewals=self.renewals))


async def settle_reachability(dht: DHT, settings: NodeSettings, dht_kwargs: dict[str, Any]) -> Reach:
    """The node's verdict (``settled()``: the final one), and the DHT to keep (a new one when it had to become a relay
    client)."""
    p2p = await replicate_p2p(dht)
    helpers = [peer for peer in (peer_of(a) for a in settings.initial_peers) if peer]
    addrs = [str(a) for a in await visible_maddrs(dht)]
    if all(_loopback(a) for a in [*addrs, *settings.initial_peers]):
        return Reach(dht, Reachability.DIRECT)  # a swarm inside one machine: every peer can dial every other
    asked = False
    for helper in helpers:
        try:
            reached = await ask_dial_back(p2p, helper, addrs)
        except Exception as exc:  # an older peer, or one without the check: ask the next
            logger.debug("peer %s did not answer the reachability check: %s", helper, exc)
            continue
        asked = True
        if reached:
            return _decided(Reach(dht, Reachability.DIRECT))
        break
    if not asked:
        logger.info("no initial peer answers reachability checks; assuming this node can be dialled directly")
        return Reach(dht, Reachability.DIRECT)
    if not settings.use_relay:
        return _decided(Reach(dht, Reachability.UNREACHABLE))
    logger.info("no peer could dial this node directly; reserving a relay slot on %s", ", ".join(helpers))
    stop_dht(dht)
    relay_client = {**dht_kwargs, **settings.relay_client_kwargs()}
    relay_client["daemon_flags"] = settings.relay_service_flags(False)  # a peer nobody can dial relays for nobody
    dht = start_dht(**relay_client)
    # The caller's watch is on the DHT it gave us, stopped now: this one is watched here, and by the caller from
    # the span's load on (``SpanServer.run``); a dead one would leave ``replicate_p2p`` waiting forever.
    p2p = await until_dht_lost(dht, replicate_p2p(dht))
    reach = Reach(dht, Reachability.UNREACHABLE)
    wait = _reserve_and_check(p2p, settings, dht.peer_id.to_base58(), reach.renewals)
    reach.pending = asyncio.create_task(wait)
    return reach


async def _reserve_and_check(p2p: P2P, settings: NodeSettings, peer_id: str, renewals: list[Periodic]) -> list[str]:
    """Reserve on every initial peer that grants a slot (renewed by tasks added to ``renewals``), then wait until a
    relay dials us back through our circuit address."""
    reservations = await reserve_any(p2p, settings.initial_peers)
    if reservations:
        logger.info("reserved a relay slot on %s", ", ".join(r.relay for r in reservations))
    else:
        logger.info("no relay granted a slot when asked; waiting for p2pd's autorelay to reserve one")
    renewals += [RelaySlot(p2p, held).keeper() for held in reservations]
    for job in renewals:
        job.start()
    return await _wait_for_relay(p2p, settings.initial_peers, peer_id, settings.relay_wait)


async def _wait_for_relay(p2p: P2P, relays: list[str], peer_id: str, wait: float) -> list[str]:
    # Asked until a relay answers: at once after our own reservation, or once autorelay took a slot (minutes).
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        for relay in relays:
            relay_peer = peer_of(relay)
            if relay_peer is None:
                continue
            try:
                reached = await ask_dial_back(p2p, relay_peer, circuit_addrs([relay], peer_id))
            except Exception as exc:
                logger.debug("relay %s did not answer: %s", relay_peer, exc)
                continue
            if reached:
                return reached
        await asyncio.sleep(RELAY_RETRY)
    return []


def _loopback(maddr: str) -> bool:
    return maddr.startswith(("/ip4/127.", "/ip6/::1/"))


def _decided(reach: Reach) -> Reach:
    relays = [a.split("/p2p-circuit")[0] for a in reach.relay_addrs]
    line = describe(reach.verdict, relays)
    if reach.verdict is Reachability.UNREACHABLE:
        logger.warning(line)
    else:
        logger.info(line)
    return reach
