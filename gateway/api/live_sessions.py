"""Every generation as a session: its record and SSE events in the store, its quota, its cancellation.

A streamed generation runs in a task of its own (the *producer*) that appends each SSE payload to the session's
event log; HTTP responses only *read* that log — the first response from event 1, a resuming client
(``GET /v1/sessions/{id}/events`` with ``Last-Event-ID``, on any replica) from where it left off. So a client that
drops loses nothing: the producer goes on while someone reads, or for ``resume_grace`` seconds after the last
reader left, and then stops (freeing the node caches) if nobody came back. Readers on other replicas say they are
there through a short-lived Redis key.

A cancel (``DELETE /v1/sessions/{id}`` on any replica, relayed by the store's pub/sub) stops the producer, or, for a
non-streamed request, the wait for its answer: the chain closes and the nodes free their caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from sse_starlette import ServerSentEvent

from gateway.api.auth import Caller
from gateway.api.errors import (
    ClientDisconnected,
    NotFound,
    RateLimited,
    ServiceUnavailable,
    SessionCancelled,
    as_api_error,
)
from gateway.api.request_log import RequestRecord
from gateway.api.sse import DONE
from gateway.sessions.quotas import QuotaExceeded, QuotaLimiter, Ticket
from gateway.sessions.redis_link import RedisDown
from gateway.sessions.store import SessionRecord, SessionStatus, SessionStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEARTBEAT_SECONDS = 2.0  # a running session's record is refreshed this often (tokens so far, liveness)
READER_KEY_SECONDS = 3  # a remote reader's presence key lives this long unless refreshed
WATCH_PERIOD = 0.5  # seconds between checks whether anyone still reads an abandoned stream
RETRY_MS = 1000  # EventSource clients reconnect after this long instead of their default (~3 s)
CANCEL_WAIT = 5.0  # DELETE waits this long for the owning replica to confirm the cancel

Disconnected = Callable[[], Awaitable[None]]


def _reader_key(session_id: str) -> str:
    return f"sg:reader:{session_id}"


class _Stopped(Exception):
    """The producer was told to stop (cancelled, or abandoned by every reader)."""


@dataclass
class _Outcome:
    status: SessionStatus = SessionStatus.FINISHED


class LiveSession:
    """A generation this replica runs, from its quota admission to its final record."""

    def __init__(self, tracker: SessionTracker, record: RequestRecord, ticket: Ticket | None) -> None:
        self.tracker = tracker
        self.record = record
        self.id = record.id
        self._ticket = ticket
        self._stop = asyncio.Event()
        self._stop_reason: SessionStatus = SessionStatus.CANCELLED
        self.readers = 0
        self._finished = False

    def stop(self) -> None:
        self._stop.set()

    def stop_waiter(self, disconnected: Disconnected) -> Disconnected:
        """Returns (the client left) or raises ``SessionCancelled`` — whichever happens first."""

        async def wait() -> None:
            left = asyncio.ensure_future(disconnected())
            stopped = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait({left, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                left.cancel()
                stopped.cancel()
            if self._stop.is_set():
                raise SessionCancelled(self.id)

        return wait

    async def finish_after(self, work: Awaitable[T], on_success: bool = True) -> T:
        """``work``'s result; the session ends with it (or only if it fails, with ``on_success`` False)."""
        try:
            result = await work
        except (SessionCancelled, ClientDisconnected, asyncio.CancelledError):
            await asyncio.shield(self._finish(SessionStatus.CANCELLED))
            raise
        except BaseException:
            await asyncio.shield(self._finish(SessionStatus.FAILED))
            raise
        if on_success:
            await asyncio.shield(self._finish(SessionStatus.FINISHED))
        return result

    def stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[ServerSentEvent]:
        """Start producing ``chunks`` into the event log; the returned iterator reads it from the first event."""
        producer = asyncio.create_task(self._produce(chunks))
        watcher = asyncio.create_task(self._watch_readers(producer))
        self.tracker.tasks.update({producer, watcher})
        producer.add_done_callback(self.tracker.tasks.discard)
        watcher.add_done_callback(self.tracker.tasks.discard)
        return self.tracker.read(self.id, 0)

    async def _produce(self, chunks: AsyncIterator[str]) -> None:
        outcome = _Outcome()
        try:
            heartbeat = time.monotonic()
            while True:
                try:
                    chunk = await self._next(chunks)
                except StopAsyncIteration:
                    break
                await self.tracker.store.append_event(self.id, chunk)
                if time.monotonic() - heartbeat > HEARTBEAT_SECONDS:
                    heartbeat = time.monotonic()
                    await self.tracker.store.update(self.id, completion_tokens=self.record.completion_tokens)
        except _Stopped:
            outcome.status = self._stop_reason
            await self.tracker.store.append_event(self.id, json.dumps(SessionCancelled(self.id).body()))
        except Exception as exc:
            outcome.status = SessionStatus.FAILED
            await self.tracker.store.append_event(self.id, json.dumps(as_api_error(exc).body()))
        finally:
            with contextlib.suppress(Exception):
                await self.tracker.store.append_event(self.id, DONE)
            await asyncio.shield(self._finish(outcome.status))

    async def _next(self, chunks: AsyncIterator[str]) -> str:
        """The next chunk, unless the session is stopped first (then the generation is cancelled where it is)."""
        step = asyncio.ensure_future(_anext(chunks))
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({step, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if step.done():
            return step.result()
        step.cancel()  # the serving generator's own cleanup closes the chain and frees the node caches
        await asyncio.gather(step, return_exceptions=True)
        with contextlib.suppress(Exception):
            await chunks.aclose()  # type: ignore[attr-defined]
        raise _Stopped

    async def _watch_readers(self, producer: asyncio.Task[None]) -> None:
        """Stop the producer once nobody has read the stream for ``resume_grace`` seconds."""
        last_seen = time.monotonic()
        while not producer.done():
            await asyncio.sleep(WATCH_PERIOD)
            if self.readers > 0 or await self.tracker.remote_reader(self.id):
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen >= self.tracker.resume_grace:
                logger.info("stream abandoned: no reader for %.1fs, stopping it", self.tracker.resume_grace)
                self._stop_reason = SessionStatus.CANCELLED
                self.stop()
                return

    async def _finish(self, status: SessionStatus) -> None:
        if self._finished:
            return
        self._finished = True
        self.tracker.live.pop(self.id, None)
        record = self.record
        # The quota first: once the record says "ended", the caller may start the next request.
        if self._ticket is not None and self.tracker.quotas is not None:
            await self.tracker.quotas.release(self._ticket, record.prompt_tokens + record.completion_tokens)
        await self.tracker.store.update(
            self.id,
            status=status,
            completion_tokens=record.completion_tokens,
            finish_reason=record.finish_reason,
            cached_tokens=record.cached_tokens,
        )
        self.tracker.store.forget(self.id)
        await self.tracker.session_ended()


class SessionTracker:
    """This replica's live sessions over the shared store, quotas and cancel channel."""

    def __init__(
        self,
        store: SessionStore,
        quotas: QuotaLimiter | None,
        model: str,
        resume_grace: float,
        max_running: int = 0,
    ) -> None:
        self.store = store
        self.quotas = quotas
        self.model = model
        self.resume_grace = resume_grace
        self.max_running = max_running  # generations at once on this replica (0: no cap)
        self.live: dict[str, LiveSession] = {}
        self.draining = False  # set on shutdown: no new generations, running ones finish
        self._ended = asyncio.Event()  # set whenever a session ends (drain re-checks what is left)
        self.tasks: set[asyncio.Task[None]] = set()
        store.on_cancel(self._cancelled)

    async def open(self, record: RequestRecord, caller: Caller, reserve_tokens: int) -> LiveSession:
        """Admit the request under the caller's quotas and file its record; raises ``RateLimited``."""
        if self.draining:
            raise ServiceUnavailable(
                "This gateway is shutting down; send the request again (to another replica).", "draining"
            )
        if self.max_running and len(self.live) >= self.max_running:
            raise RateLimited(
                f"This gateway is running its limit of {self.max_running} generations; please retry shortly.",
                "requests",
                1,
            )
        ticket = None
        if self.quotas is not None and caller.key_id is not None and _limited(caller):
            try:
                ticket = await self.quotas.admit(caller.key_id, caller.limits, reserve_tokens)
            except QuotaExceeded as exc:
                kind = "tokens" if exc.limit == "tokens per minute" else "requests"
                raise RateLimited(
                    f"Rate limit reached for {exc.limit} on this API key. Please try again in {exc.retry_after}s.",
                    kind,
                    exc.retry_after,
                ) from None
        live = LiveSession(self, record, ticket)
        self.live[record.id] = live
        try:
            await self.store.save(self.store.new_record(record.id, self.model, caller.key_id, record.prompt_tokens))
        except BaseException:
            await live._finish(SessionStatus.FAILED)
            raise
        return live

    def _cancelled(self, session_id: str) -> None:
        live = self.live.get(session_id)
        if live is not None:
            logger.info("session %s cancelled: stopping it", session_id)
            live.stop()

    # -- reading -----------------------------------------------------------------------------------------------------

    async def read(self, session_id: str, after: int) -> AsyncIterator[ServerSentEvent]:
        """The session's events after ``after`` as SSE, then its live tail until it ends (ids are event numbers)."""
        live = self.live.get(session_id)
        gone = asyncio.Event()
        if live is not None:
            live.readers += 1
        else:
            presence = asyncio.create_task(self._announce_reader(session_id, gone))
            self.tasks.add(presence)
            presence.add_done_callback(self.tasks.discard)
        try:
            first = True
            async for number, data in self.store.events_after(session_id, after):
                yield ServerSentEvent(data=data, id=str(number), retry=RETRY_MS if first else None)
                first = False
        finally:
            if live is not None:
                live.readers -= 1
            # The announcer stops by itself: a cancel() did not reliably reach it from here (the response's
            # generator is finalized inside sse-starlette's task group), and awaiting it could hang the response.
            gone.set()

    async def _announce_reader(self, session_id: str, gone: asyncio.Event) -> None:
        """Tell the owning replica (through Redis) that someone here still reads its stream, until ``gone``."""
        while not gone.is_set():
            with contextlib.suppress(RedisDown):
                await self.store.link.run(lambda r: r.set(_reader_key(session_id), "1", ex=READER_KEY_SECONDS))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), 1.0)

    async def remote_reader(self, session_id: str) -> bool:
        try:
            return bool(await self.store.link.run(lambda r: r.exists(_reader_key(session_id))))
        except RedisDown:
            return False

    # -- the /v1/sessions API ------------------------------------------------------------------------------------------

    async def visible(self, session_id: str, caller: Caller) -> SessionRecord:
        """The session's record if the caller may see it (its own, or any for an admin); else 404."""
        record = await self.store.get(session_id)
        if record is None or not (caller.admin or record.key_id == caller.key_id):
            raise NotFound(f"No session with id {session_id!r}.", "session_not_found", "session_id")
        return record

    async def cancel(self, session_id: str, caller: Caller) -> SessionRecord:
        """Cancel a running session wherever it runs; returns its record once the owner confirms (or as it is)."""
        record = await self.visible(session_id, caller)
        if record.ended:
            return record
        await self.store.publish_cancel(session_id)
        deadline = time.monotonic() + CANCEL_WAIT
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            current = await self.store.get(session_id)
            if current is not None and current.ended:
                return current
        logger.warning("session %s: no replica confirmed its cancel within %.0fs", session_id, CANCEL_WAIT)
        return await self.store.get(session_id) or record

    async def drain(self) -> None:
        """Refuse new generations and wait until the running ones have ended (the caller bounds the wait)."""
        self.draining = True
        while self.live:
            self._ended.clear()
            await self._ended.wait()

    async def session_ended(self) -> None:
        self._ended.set()

    async def close(self) -> None:
        for live in list(self.live.values()):
            live.stop()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=10)


async def _anext(chunks: AsyncIterator[str]) -> str:
    return await anext(chunks)


def _limited(caller: Caller) -> bool:
    limits = caller.limits
    return bool(limits.requests_per_minute or limits.tokens_per_minute or limits.concurrent_streams)
