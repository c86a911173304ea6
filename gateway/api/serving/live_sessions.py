"""Every generation as a session: its record and SSE events in the store, its quota, its cancellation.

A streamed generation runs in a task of its own (the *producer*) that appends each SSE payload to the session's
event log — in this replica's memory at once, and teed to Redis in the background (no Redis round trip sits between
a token and its client). HTTP responses *read* that log: the first response from event 1 straight from memory, a
resuming client (``GET /v1/sessions/{id}/events`` with ``Last-Event-ID``, on any replica) from where it left off.
So a client that drops loses nothing: the producer goes on while someone reads, or for ``resume_grace`` seconds
after the last reader left, and then stops (freeing the node caches) if nobody came back. Readers on other replicas
say they are there through a short-lived Redis key.

Every stream ends with ``[DONE]``: after its last chunk, or after an error event. A running session's record is
refreshed every ``HEARTBEAT_SECONDS`` by the replica that runs it, whether or not tokens flow (a node may be stalled,
or failover may be waiting for a replacement); a reader on another replica gives that replica up only when the
heartbeat has been missing for ``STALE_AFTER`` seconds, and then ends with a ``session_lost`` error event. While a
stream has nothing to send, its reader sends ``: keep-alive`` comment lines so clients and proxies don't time out.

A cancel (``DELETE /v1/sessions/{id}`` on any replica, relayed by the store's pub/sub) stops the producer, or, for a
non-streamed request, the wait for its answer: the chain closes and the nodes free their caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import NoReturn, TypeVar

from sse_starlette import ServerSentEvent

from gateway.api.auth import Caller
from gateway.api.errors import (
    ClientDisconnected,
    NotFound,
    RateLimited,
    ServiceUnavailable,
    SessionCancelled,
    SessionEnded,
    SessionStopped,
    as_api_error,
)
from gateway.api.request_log import RequestRecord
from gateway.api.serving.stop_signals import race
from gateway.api.sse import DONE, sse_event
from gateway.state.quotas import QuotaExceeded, QuotaLimiter, Ticket
from gateway.state.redis_link import RedisDown
from gateway.state.store import STALE_AFTER, SessionRecord, SessionStatus, SessionStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A running session's record is refreshed this often by its replica; readers elsewhere wait STALE_AFTER (many
# missed beats) before they call the replica gone.
HEARTBEAT_SECONDS = 3.0
KEEPALIVE_SECONDS = 10.0  # an idle stream sends a comment line this often (proxies close idle ones at 30-60 s)
WATCH_PERIOD = 0.5  # seconds between checks whether anyone still reads an abandoned stream
# Before its first reader came, a stream is abandoned only after this long (or ``resume_grace``, if longer): the
# response returned with it starts reading once the event loop runs it, which a starved process can delay past
# ``resume_grace`` (CI saw a stream stopped before its client read a token); one whose client left before the
# response started is stopped after it.
FIRST_READER_GRACE = 30.0
RETRY_MS = 1000  # EventSource clients reconnect after this long instead of their default (~3 s)
STOP_ALL_WAIT = 3.0  # seconds stopped generations get to write their error event and [DONE] before the server stops
CANCEL_WAIT = 5.0  # DELETE waits this long for the owning replica to confirm the cancel
SLOW_STOP_SECONDS = 2.0  # a stopped generation's cleanup taking longer than this is logged
# A bare comment line, no blank line after it: the openai client dispatches an empty event at a blank line once an
# event id was seen, and fails to parse it (a comment alone between two events is ignored by every SSE parser).
KEEPALIVE_LINE = b": keep-alive\n"


def session_lost(session_id: str) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"The gateway replica running session {session_id} stopped answering (no heartbeat for {STALE_AFTER:.0f}s);"
        " its output ends here.",
        "session_lost",
    )


class LiveSession:
    """A generation this replica runs, from its quota admission to its final record."""

    def __init__(self, tracker: SessionTracker, record: RequestRecord, ticket: Ticket | None) -> None:
        self.tracker = tracker
        self.record = record
        self.id = record.id
        self._ticket = ticket
        self._stop = asyncio.Event()
        self._stop_reason: str | None = None  # said in the session's error; None: a DELETE
        self._stop_error: type[SessionCancelled | SessionStopped] = SessionCancelled  # Stopped: the gateway shuts down
        self.readers = 0
        self.read_once = False  # whether any reader, here or on another replica, has come (FIRST_READER_GRACE before)
        self._finished = False

    def stop(self, why: str | None = None, error: type[SessionCancelled | SessionStopped] = SessionCancelled) -> None:
        """Stop the generation; ``why`` goes into its ``error`` (by default, a DELETE of the session)."""
        if not self._stop.is_set():
            self._stop_reason, self._stop_error = why, error
        self._stop.set()

    async def cancelled(self) -> NoReturn:
        """A stop signal: fires with ``SessionCancelled`` (or ``SessionStopped``) once the session is told to stop."""
        await self._stop.wait()
        raise self._stop_error(self.id, self._stop_reason)

    async def finish_after(self, work: Awaitable[T], on_success: bool = True) -> T:
        """``work``'s result; the session ends with it (or only if it fails, with ``on_success`` False)."""
        try:
            result = await work
        except (SessionEnded, ClientDisconnected, asyncio.CancelledError):
            await asyncio.shield(self._finish(SessionStatus.CANCELLED))
            raise
        except BaseException:
            await asyncio.shield(self._finish(SessionStatus.FAILED))
            raise
        if on_success:
            await asyncio.shield(self._finish(SessionStatus.FINISHED))
        return result

    def stream(self, chunks: AsyncGenerator[str, None]) -> AsyncIterator[ServerSentEvent | bytes]:
        """Start producing ``chunks`` into the event log; the returned iterator reads it from the first event."""
        producer = asyncio.create_task(self._produce(chunks))
        watcher = asyncio.create_task(self._watch_readers(producer))
        self.tracker.tasks.update({producer, watcher})
        producer.add_done_callback(self.tracker.tasks.discard)
        watcher.add_done_callback(self.tracker.tasks.discard)
        return self.tracker.read(self.id, 0)

    async def _produce(self, chunks: AsyncGenerator[str, None]) -> None:
        """Every chunk into the log, then ``[DONE]``; a cancel or a failure is a final error event before it.

        A cancel ends the stream and the record at once: the client and the replica that relayed the cancel don't
        wait for the generation's cleanup (closing its node sessions), which runs on; the producer ends after it."""
        pump = asyncio.ensure_future(self._pump(chunks))
        status = SessionStatus.FINISHED
        try:
            await race(asyncio.shield(pump), self.cancelled)
        except SessionEnded as exc:
            status = SessionStatus.CANCELLED
            pump.cancel()
            await self.tracker.store.append_event(self.id, json.dumps(exc.body()))
        except Exception as exc:
            status = SessionStatus.FAILED
            await self.tracker.store.append_event(self.id, json.dumps(as_api_error(exc).body()))
        except asyncio.CancelledError:  # this producer stopped from outside (the loop shutting down)
            status = SessionStatus.CANCELLED
            raise
        finally:
            pump.cancel()  # a no-op once it ended
            with contextlib.suppress(Exception):
                await self.tracker.store.append_event(self.id, DONE)
            await asyncio.shield(self._finish(status))
            await self._settled(pump)

    async def _pump(self, chunks: AsyncGenerator[str, None]) -> None:
        # Cancelled by a stop signal: the serving generator's own cleanup closes the chain and frees the node caches.
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                await self.tracker.store.append_event(self.id, chunk)

    async def _settled(self, pump: asyncio.Future[None]) -> None:
        """Wait for a stopped generation's cleanup; one that takes long is logged (its node caches stay held)."""
        began = time.monotonic()
        while not pump.done():  # cancelled again now and then: one await that swallows a cancel must not keep it going
            await asyncio.wait({pump}, timeout=SLOW_STOP_SECONDS)
            pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        if (took := time.monotonic() - began) > SLOW_STOP_SECONDS:
            logger.warning("session %s: its generation took %.1fs to stop", self.id, took)

    async def _watch_readers(self, producer: asyncio.Task[None]) -> None:
        """Stop the producer once nobody has read the stream for ``resume_grace`` seconds (``FIRST_READER_GRACE``
        before its first reader came)."""
        last_seen = time.monotonic()
        while not producer.done():
            await asyncio.sleep(WATCH_PERIOD)
            grace = self.tracker.resume_grace if self.read_once else max(self.tracker.resume_grace, FIRST_READER_GRACE)
            if self.readers > 0 or await self.tracker.remote_reader(self.id):
                last_seen, self.read_once = time.monotonic(), True  # a reader on another replica counts too
            elif time.monotonic() - last_seen >= grace:
                logger.info("stream abandoned: no reader for %.1fs, stopping it", grace)
                self.stop(f"no client read its stream for {grace:.1f}s")
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
        keepalive: float = KEEPALIVE_SECONDS,
    ) -> None:
        self.store = store
        self.quotas = quotas
        self.model = model
        self.resume_grace = resume_grace
        self.max_running = max_running  # generations at once on this replica (0: no cap)
        self.keepalive = keepalive  # seconds between comment lines on a stream that has nothing to send
        self.live: dict[str, LiveSession] = {}
        self.draining = False  # set on shutdown: no new generations, running ones finish
        self._ended = asyncio.Event()  # set whenever a session ends (drain re-checks what is left)
        self.tasks: set[asyncio.Task[None]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
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
        self._beat()
        return live

    def _cancelled(self, session_id: str) -> None:
        live = self.live.get(session_id)
        if live is not None:
            logger.info("session %s cancelled: stopping it", session_id)
            live.stop()

    # -- liveness ----------------------------------------------------------------------------------------------------

    def _beat(self) -> None:
        """Make sure the heartbeat runs (it stops by itself once no session is left)."""
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.create_task(self._heartbeats())

    async def _heartbeats(self) -> None:
        """Refresh every running session's record: its liveness is this, not the chunks it happens to produce."""
        while self.live:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            for live in list(self.live.values()):
                try:
                    await self.store.touch(live.id, completion_tokens=live.record.completion_tokens)
                except Exception:
                    logger.exception("heartbeat of session %s failed", live.id)

    # -- reading -----------------------------------------------------------------------------------------------------

    async def read(self, session_id: str, after: int) -> AsyncIterator[ServerSentEvent | bytes]:
        """The session's events after ``after`` as SSE, then its live tail until it ends (ids are event numbers).

        Always ends with ``[DONE]``: a session whose replica stopped its heartbeat gets a ``session_lost`` error
        event first. Comment lines keep an idle stream open."""
        live = self.live.get(session_id)
        gone = asyncio.Event()
        if live is not None:
            live.readers += 1
            live.read_once = True
        else:
            presence = asyncio.create_task(self._announce_reader(session_id, gone))
            self.tasks.add(presence)
            presence.add_done_callback(self.tasks.discard)
        try:
            first, done = True, False
            async for item in self.store.events_after(session_id, after, idle=self.keepalive):
                if item is None:
                    yield KEEPALIVE_LINE
                    continue
                number, data = item
                yield sse_event(data, id=str(number), retry=RETRY_MS if first else None)
                first, done = False, done or data == DONE
            if not done:
                async for event in self._ending(session_id):
                    yield event
        finally:
            if live is not None:
                live.readers -= 1
            # The announcer stops by itself: a cancel() did not reliably reach it from here (the response's
            # generator is finalized inside sse-starlette's task group), and awaiting it could hang the response.
            gone.set()

    async def _ending(self, session_id: str) -> AsyncIterator[ServerSentEvent]:
        """The end of a log without ``[DONE]``: a session that ended (a non-streamed one has no events) just ends;
        one whose replica is gone gets an error event first."""
        record = await self.store.get(session_id)
        if record is None or not record.ended:
            logger.warning("session %s: its replica stopped its heartbeat; ending the stream with an error", session_id)
            yield sse_event(json.dumps(session_lost(session_id).body()))
        yield sse_event(DONE)

    async def _announce_reader(self, session_id: str, gone: asyncio.Event) -> None:
        """Tell the owning replica (through Redis) that someone here still reads its stream, until ``gone``."""
        while not gone.is_set():
            with contextlib.suppress(RedisDown):
                await self.store.mark_reader(session_id)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await gone.wait()

    async def remote_reader(self, session_id: str) -> bool:
        try:
            return await self.store.has_reader(session_id)
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
        if not self.live and self._heartbeat is not None:
            self._heartbeat.cancel()  # nothing left to keep alive; the next session starts another
            self._heartbeat = None

    async def stop_all(self, why: str, wait: float = STOP_ALL_WAIT) -> None:
        """Stop every running generation as the gateway shuts down (a non-streamed request answers 503, a stream ends
        with an error event saying ``why``, then ``[DONE]``) and wait up to ``wait`` seconds for them to end."""
        for live in list(self.live.values()):
            live.stop(why, SessionStopped)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self.drain()

    async def close(self) -> None:
        await self.stop_all("the gateway is shutting down", wait=0)
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=10)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)


def _limited(caller: Caller) -> bool:
    limits = caller.limits
    return bool(limits.requests_per_minute or limits.tokens_per_minute or limits.concurrent_streams)
