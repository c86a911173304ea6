"""A ``start_dht`` whose DHT dies as it starts, for scripts that test a process started that way (run in a fresh
interpreter from the repository's root: hivemind forks the DHT child, and a fork of a pytest worker can deadlock)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import psutil
from hivemind import DHT


def killed_as_started(start: Callable[..., DHT]) -> Callable[..., DHT]:
    """``start`` wrapped: the DHT child SIGKILLed (with its p2pd) before its caller gets it back."""

    def start_and_kill(**kwargs: Any) -> DHT:
        dht = start(**kwargs)
        daemons = psutil.Process(dht.pid).children(recursive=True)
        dht.kill()
        dht.join(5)
        for daemon in daemons:
            with contextlib.suppress(psutil.Error):
                daemon.kill()
        return dht

    return start_and_kill
