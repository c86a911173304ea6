"""One process at a time on this machine: an exclusive ``flock`` on a lock file beside a shared cache.

Nodes (and gateways) starting together share on-disk caches (the GGUF config, the throughput figures); the first
one computes and the others wait for its result instead of each computing it. The kernel drops the lock when its
holder closes the file or dies, so a crashed holder never blocks the others. A lock file that cannot be made (a
read-only folder) costs only the wait: the caller then computes on its own, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.1  # the async waiter polls: a blocking flock in a worker thread would outlive a cancellation


def _opened(lock: Path) -> IO[str] | None:
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        return lock.open("a")
    except OSError:
        logger.warning(
            "cannot open the lock file %s; going on without waiting for other processes", lock, exc_info=True
        )
        return None


@contextlib.contextmanager
def held(lock: Path) -> Iterator[None]:
    """Blocks until this process holds ``lock`` (for threads and start-up code, never the event loop)."""
    handle = _opened(lock)
    if handle is None:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@contextlib.asynccontextmanager
async def held_async(lock: Path) -> AsyncIterator[None]:
    """Waits (polling, so the loop stays free and a cancel ends the wait) until this process holds ``lock``."""
    handle = _opened(lock)
    if handle is None:
        yield
        return
    with handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(POLL_SECONDS)
        yield
