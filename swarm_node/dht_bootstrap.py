"""`swarm_node dht`: a bootstrap DHT peer that others join; its multiaddrs go to stdout, one per line.

It answers joining nodes' reachability checks (shared.reachability), and with --relay-hop (the default) it is also
the swarm's relay of last resort: it relays connections to nodes behind NAT, within the --relay-max-* limits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from hivemind import DHT
from hivemind.utils.multiaddr import Multiaddr

from shared.dht_process import replicate_p2p, start_dht, stop_dht, until_dht_lost, visible_maddrs
from shared.errors import DhtLost
from shared.reachability import DialBackService
from swarm_node.settings import DhtSettings

logger = logging.getLogger(__name__)


def run_bootstrap(settings: DhtSettings) -> None:
    asyncio.run(_run_bootstrap(settings))


async def _run_bootstrap(settings: DhtSettings) -> None:
    dht = start_dht(**settings.dht_kwargs())
    try:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            maddrs = await until_dht_lost(dht, _start_answering(dht))
        except DhtLost as lost:
            logger.error("%s while the peer started; stopping", lost)
            raise
        for maddr in maddrs:
            sys.stdout.write(f"{maddr}\n")
        sys.stdout.flush()
        logger.info("DHT bootstrap peer %s is up (relay %s)", dht.peer_id, "on" if settings.relay_hop else "off")
        try:
            await until_dht_lost(dht, stop.wait())
        except DhtLost as lost:
            logger.error("%s: this peer can no longer answer the swarm; stopping", lost)
            raise
    finally:
        stop_dht(dht)


async def _start_answering(dht: DHT) -> list[Multiaddr]:
    """Answer reachability checks; the addresses peers can reach us at."""
    await DialBackService(await replicate_p2p(dht)).register()
    return await visible_maddrs(dht)
