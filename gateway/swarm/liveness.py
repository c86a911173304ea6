"""Noticing a dead or frozen node in about a second instead of at the step timeout.

Why a ping: with hivemind 1.1.12 a stream to a node that was SIGKILLed never ends on the reader's side — the
gateway's p2pd learns the connection is gone, but a reply being awaited stays pending until the next send (checked:
a step awaited across the kill was still pending 12 s later, while an info call to the node failed with "stream
reset" / "failed to dial" within 10 ms). A SIGSTOPped node keeps its TCP connection, so nothing ends at all, but it
answers no call. A node that is merely busy does answer: its RPC loop never runs torch (the compute thread does).

So while a reply is overdue — later than a few of the node's measured reply times, with a floor — the waiter pings
the node with its info RPC, once per ``PING_PERIOD``: a failed ping means the node is gone, an unanswered one that it
is frozen; both raise ``NodeUnreachable`` at once. A node that answers pings gets the whole step timeout, so a slow
prefill on a healthy node is never cut short. Concurrent waiters on one node share one ping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from hivemind.p2p import P2P

from shared.errors import NodeUnreachable, StepTimeout, SwarmError
from shared.membership import CallAuth
from shared.rpc_client import fetch_info, over_transport

logger = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_FLOOR = 1.0  # seconds a reply may take before the node is pinged, however fast it usually is
PROBE_FACTOR = 4.0  # ... or this many of its measured reply times, if that is longer
PROBE_CEILING = 5.0  # ... but never later than this: one long prefill must not blind the watch on later steps
PING_TIMEOUT = 3.0  # seconds a live node gets to answer a ping (generous: a busy 2-core box delays p2pd too)
PING_PERIOD = 1.0  # seconds between pings while a reply stays overdue
SMOOTHING = 0.2  # weight of a new reply time in its moving average


class Liveness:
    def __init__(self, p2p: P2P, auth: CallAuth | None = None) -> None:
        self._p2p = p2p
        self._auth = auth
        self.reply_times: dict[str, float] = {}  # peer -> moving average of its reply times, seconds
        self._pings: dict[str, tuple[asyncio.Future[None], float]] = {}  # peer -> its last ping, sent when

    def probe_after(self, peer_id: str) -> float:
        """Seconds a reply from ``peer_id`` may take before the node is pinged."""
        return min(PROBE_CEILING, max(PROBE_FLOOR, PROBE_FACTOR * self.reply_times.get(peer_id, 0.0)))

    async def wait(self, peer_id: str, what: str, work: Awaitable[T], limit: float) -> T:
        """Await ``work`` (a reply from ``peer_id``) for up to ``limit`` seconds (``StepTimeout`` after that),
        raising ``NodeUnreachable`` as soon as the node fails a ping. Transport errors come out typed."""
        began = time.monotonic()
        task = asyncio.ensure_future(over_transport(peer_id, what, work, limit))
        task.add_done_callback(_retrieve)  # a waiter cancelled as the reply failed (an abandoned pushed step)
        try:
            delay = self.probe_after(peer_id)
            while True:
                done, _ = await asyncio.wait({task}, timeout=delay)
                if done:
                    result = task.result()
                    self._measured(peer_id, time.monotonic() - began)
                    return result
                await self.ping(peer_id)
                delay = PING_PERIOD
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def ping(self, peer_id: str) -> None:
        """Returns if the node answers (whatever it answers); raises ``NodeUnreachable`` if it is gone or frozen.
        A ping in flight, or one sent less than ``PING_PERIOD`` ago, answers for every waiter: their timers need
        not fire in one turn of the loop to share it."""
        now = time.monotonic()
        ping, sent = self._pings.get(peer_id, (None, 0.0))
        if ping is None or (ping.done() and now - sent >= PING_PERIOD):
            ping = asyncio.ensure_future(self._ping(peer_id))
            ping.add_done_callback(_retrieve)  # its waiters may all be gone by the time it fails
            self._pings[peer_id] = (ping, now)
        await asyncio.shield(ping)

    async def _ping(self, peer_id: str) -> None:
        try:
            await fetch_info(self._p2p, peer_id, PING_TIMEOUT, self._auth)
        except StepTimeout:
            raise NodeUnreachable(f"node {peer_id} answers no ping within {PING_TIMEOUT:g}s (frozen?)") from None
        except NodeUnreachable as exc:
            raise NodeUnreachable(f"node {peer_id} is gone: {exc}") from None
        except SwarmError:
            pass  # it answered, if only with an error: it is alive

    def _measured(self, peer_id: str, seconds: float) -> None:
        old = self.reply_times.get(peer_id)
        self.reply_times[peer_id] = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
