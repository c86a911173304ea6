"""`swarm_node dht`: a bootstrap DHT peer that others join; its multiaddrs go to stdout, one per line."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from shared.dht_process import start_dht
from swarm_node.settings import DhtSettings

logger = logging.getLogger(__name__)


def run_bootstrap(settings: DhtSettings) -> None:
    dht = start_dht(**settings.dht_kwargs())
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for maddr in dht.get_visible_maddrs():
        sys.stdout.write(f"{maddr}\n")
    sys.stdout.flush()
    logger.info("DHT bootstrap peer %s is up", dht.peer_id)
    stop.wait()
    dht.shutdown()
