"""Open inference sessions on a node: their KV caches, their cache-pool allocations, and idle expiry.

A session is opened by an inference stream and lives until the stream closes it, the stream ends, or it sits idle
(no step running or arriving) for longer than the idle timeout — a client that vanished without closing must not
hold cache room forever. Closing is idempotent; it returns the room to the pool and drops the session's KV tensors
at once, even while its stream is still open (a later step then gets ``UnknownSession``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from shared.errors import PushRefused, UnknownSession
from swarm_node.cache_pool import Allocation
from swarm_node.fair_share import Holding
from swarm_node.kv_cache import SessionKV
from swarm_node.step_slots import StepSlots

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


class Session:
    def __init__(self, kv: SessionKV, allocation: Allocation, now: float, owner: str = "") -> None:
        self.session_id = uuid.uuid4().hex  # random: a name only its opener learns
        self.owner = owner  # peer id of the client that opened it: only it may step it on the batch stream
        self.pusher: str | None = None  # the node before this one in the opener's chain: it may push steps here
        self.slots = StepSlots()  # the latest decode step, run once whether pushed or sent by the opener
        self.first_block = kv.first_block
        self.end_block = kv.first_block + kv.num_layers
        self.max_length = kv.max_length
        self.allocation = allocation
        self.last_active = now
        self.busy = False  # a step is running: never idle
        self.ended: str | None = None  # why it ended: "closed" or "expired"
        self._kv: SessionKV | None = kv

    @property
    def blocks(self) -> tuple[int, int]:
        return self.first_block, self.end_block

    @property
    def kv(self) -> SessionKV:
        if self._kv is None:
            raise UnknownSession(f"session {self.session_id} has {self.ended}")
        return self._kv

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
            self._kv = None  # the KV tensors are freed with their last reference: this one
            self.allocation.release()
            self.slots.end()


class SessionRegistry:
    def __init__(self, idle_timeout: float, clock: Clock = time.monotonic) -> None:
        self.idle_timeout = idle_timeout
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, kv: SessionKV, allocation: Allocation, owner: str = "") -> Session:
        session = Session(kv, allocation, self._clock(), owner)
        self._sessions[session.session_id] = session
        return session

    def holdings(self) -> dict[str, Holding]:
        """Each owner's open sessions and the cache tokens they hold (what ``FairShare`` limits)."""
        held: dict[str, Holding] = {}
        for session in self._sessions.values():
            before = held.get(session.owner, Holding())
            held[session.owner] = Holding(before.sessions + 1, before.tokens + session.allocation.tokens)
        return held

    def owned(self, session_id: str, owner: str) -> Session:
        """The open session ``session_id`` if ``owner`` opened it; else ``UnknownSession`` (the same answer whether it
        never existed, ended, or is someone else's: a session's name tells another client nothing)."""
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise UnknownSession(f"no open session {session_id!r} of this client")
        return session

    def pushable(self, session_id: str, pusher: str) -> Session:
        """The open session ``session_id`` if ``pusher`` may push into it (its opener, or the peer the opener named);
        else ``PushRefused``, the same whether the session exists or not."""
        session = self._sessions.get(session_id)
        if session is None or pusher not in (session.owner, session.pusher):
            raise PushRefused(f"peer {pusher} may not push into session {session_id!r}")
        return session

    def close(self, session: Session, reason: str = "closed") -> None:
        self._sessions.pop(session.session_id, None)
        session.end(reason)

    @contextmanager
    def active(self, session: Session) -> Iterator[SessionKV]:
        """The session's KV for one step; the session is not idle meanwhile. Raises ``UnknownSession`` if ended."""
        kv = session.kv
        session.busy = True
        try:
            yield kv
        finally:
            session.busy = False
            session.last_active = self._clock()

    def expire_idle(self) -> list[Session]:
        now = self._clock()
        idle = [s for s in self._sessions.values() if not s.busy and now - s.last_active > self.idle_timeout]
        for session in idle:
            logger.info("session %s expired after %.0fs idle", session.session_id, now - session.last_active)
            self.close(session, "expired")
        return idle

    @property
    def expiry_period(self) -> float:
        """Seconds between looks for idle sessions: a few per timeout period."""
        return min(max(self.idle_timeout / 4, 0.05), 10.0)

    async def expire(self) -> None:
        """``expire_idle`` as a periodic job."""
        self.expire_idle()
