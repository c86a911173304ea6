"""Session records and their event streams in Redis, with an in-memory copy that carries the gateway through outages.

Keys (``sg:`` prefix):
    sg:session:{id}        JSON record; expires ``ttl`` seconds after the session ends
    sg:sessions:all        sorted set of ids by creation time (admin listing)
    sg:sessions:key:{kid}  the same, per API key
    sg:events:{id}         Redis stream of the session's SSE payloads; entry ids ``0-N`` where N is the SSE event id
    sg:cancel              pub/sub channel: a session id published there is cancelled by whichever replica runs it
    sg:reader:{id}         present while a reader on some replica follows the session's stream (expires quickly)

This replica keeps every record and event it writes for its running sessions in memory too: its own readers read
that copy (no Redis round trip between a chunk and its client), events reach Redis through a background *tee* (in
order, batched), and a record that says "ended" is written only once every event is in Redis. While Redis is down
the copy serves every read, and everything written meanwhile is written through when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from enum import StrEnum

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, ValidationError
from redis.exceptions import RedisError

from gateway.state.redis_link import RedisDown, RedisLink
from shared.background import stop_task

logger = logging.getLogger(__name__)

CANCEL_CHANNEL = "sg:cancel"
EVENTS_KEPT = 100_000  # per session: far more than any generation's chunks
TAIL_BLOCK_MS = 300  # below the link's socket timeout (0.5 s), or a quiet tail would read as Redis down
# Seconds without a heartbeat (the owning replica refreshes a running record every few seconds, tokens or not) after
# which that replica is presumed dead.
STALE_AFTER = 30.0


class SessionStatus(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class SessionRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    model: str
    key_id: str | None = None
    replica: str
    status: SessionStatus = SessionStatus.RUNNING
    route: list[str] = []
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    created_at: float
    updated_at: float

    @property
    def ended(self) -> bool:
        return self.status is not SessionStatus.RUNNING

    def stale(self, now: float) -> bool:
        """Running, but its replica stopped refreshing it (it crashed): nothing more will come."""
        return not self.ended and now - self.updated_at > STALE_AFTER


def _record_key(session_id: str) -> str:
    return f"sg:session:{session_id}"


def _events_key(session_id: str) -> str:
    return f"sg:events:{session_id}"


def _reader_key(session_id: str) -> str:
    return f"sg:reader:{session_id}"


READER_KEY_SECONDS = 3  # a remote reader's presence key lives this long unless refreshed


def _index_key(key_id: str | None) -> str:
    return "sg:sessions:all" if key_id is None else f"sg:sessions:key:{key_id}"


class SessionStore:
    def __init__(self, link: RedisLink, replica: str, ttl: float = 3600.0) -> None:
        self.link = link
        self.replica = replica
        self.ttl = int(ttl)
        self._records: dict[str, SessionRecord] = {}  # this replica's sessions (running, or ended recently)
        self._events: dict[str, list[tuple[int, str]]] = {}
        self._unsynced_records: set[str] = set()
        self._write_locks: dict[str, asyncio.Lock] = {}
        self._stored_events: dict[str, int] = {}  # session id -> events Redis holds (as far as we know)
        self._tees: dict[str, asyncio.Task[None]] = {}  # session id -> its writer of events Redis lacks
        self._unsynced_events: dict[str, int] = {}  # session id -> first event number not yet in Redis
        self._tailing: Counter[str] = Counter()  # session id -> readers on this replica tailing its events
        self._forget_after_tail: set[str] = set()  # ended and synced, dropped once its last local reader is done
        # Set (and replaced) on every change: waiters hold the event of their time. Not an asyncio.Condition:
        # Python 3.11's wait_for() on Condition.wait() can time out mid-reacquire and leave the lock broken,
        # which stalls every later writer.
        self._changed = asyncio.Event()
        self._cancel_callbacks: list[Callable[[str], None]] = []
        self._listener: asyncio.Task[None] | None = None
        link.on_recovery(self._write_through)

    # -- records -------------------------------------------------------------------------------------------------

    def new_record(self, session_id: str, model: str, key_id: str | None, prompt_tokens: int) -> SessionRecord:
        now = time.time()
        return SessionRecord(
            id=session_id,
            model=model,
            key_id=key_id,
            replica=self.replica,
            prompt_tokens=prompt_tokens,
            created_at=now,
            updated_at=now,
        )

    async def save(self, record: SessionRecord) -> None:
        self._prune(record.updated_at)
        await self._put(record)

    async def _put(self, record: SessionRecord) -> None:
        self._records[record.id] = record
        if record.ended:  # readers elsewhere take "ended" to mean every event is in Redis
            await self._flush_events(record.id)
        try:
            await self._write_latest(record.id)
            self._unsynced_records.discard(record.id)
        except RedisDown:
            self._unsynced_records.add(record.id)
        self._notify()

    async def update(self, session_id: str, **changes: object) -> SessionRecord | None:
        record = self._records.get(session_id) or await self.get(session_id)
        if record is None:
            return None
        updated = record.model_copy(update={**changes, "updated_at": time.time()})
        await self.save(updated)
        return updated

    async def touch(self, session_id: str, **changes: object) -> None:
        """The heartbeat: refresh a running session this replica holds (a no-op once it ended or was forgotten)."""
        record = self._records.get(session_id)
        if record is not None and not record.ended:
            await self._put(record.model_copy(update={**changes, "updated_at": time.time()}))  # no prune: it's O(n)

    async def _write_latest(self, session_id: str) -> None:
        """Write the session's newest record. One write per session at a time, each taking the newest version when
        it starts: a write-through racing the session's own updates can't leave an older status in Redis last."""
        async with self._write_lock(session_id):
            await self._write_latest_locked(session_id)

    async def _write_latest_locked(self, session_id: str) -> None:
        record = self._records.get(session_id)
        if record is not None:
            await self.link.run(lambda r: self._write_record(r, record))

    def _write_lock(self, session_id: str) -> asyncio.Lock:
        return self._write_locks.setdefault(session_id, asyncio.Lock())

    async def _write_record(self, client: aioredis.Redis, record: SessionRecord) -> None:
        async with client.pipeline(transaction=True) as pipe:
            pipe.set(_record_key(record.id), record.model_dump_json())
            pipe.zadd(_index_key(None), {record.id: record.created_at})
            if record.key_id is not None:
                pipe.zadd(_index_key(record.key_id), {record.id: record.created_at})
            if record.ended:
                pipe.expire(_record_key(record.id), self.ttl)
                pipe.expire(_events_key(record.id), self.ttl)
            await pipe.execute()

    async def get(self, session_id: str) -> SessionRecord | None:
        # Written here while Redis was down: newer than what Redis holds until the write-through (which runs after
        # Redis reads as up again) reaches it.
        if session_id in self._unsynced_records:
            return self._records.get(session_id)
        try:
            raw = await self.link.run(lambda r: r.get(_record_key(session_id)))
        except RedisDown:
            return self._records.get(session_id)
        if raw is None:
            return self._records.get(session_id)
        return _parse(str(raw))

    async def list_sessions(self, key_id: str | None) -> list[SessionRecord]:
        """Newest first: the caller's sessions, or every session when ``key_id`` is None (admin)."""
        held = [rec for rec in self._records.values() if key_id is None or rec.key_id == key_id]
        try:
            records = await self.link.run(lambda r: self._read_index(r, key_id))
        except RedisDown:
            records = held
        else:  # as in get(): what was written here while Redis was down is newer than Redis's copy
            unsynced = {rec.id: rec for rec in held if rec.id in self._unsynced_records}
            records = [unsynced.pop(rec.id, rec) for rec in records] + list(unsynced.values())
        return sorted(records, key=lambda rec: rec.created_at, reverse=True)

    async def _read_index(self, client: aioredis.Redis, key_id: str | None) -> list[SessionRecord]:
        ids = [str(i) for i in await client.zrevrange(_index_key(key_id), 0, -1)]
        raws = await client.mget([_record_key(i) for i in ids]) if ids else []
        expired = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
        if expired:  # records expire on their own; the index is pruned lazily here
            await client.zrem(_index_key(key_id), *expired)
        return [rec for raw in raws if raw is not None and (rec := _parse(str(raw))) is not None]

    # -- events ----------------------------------------------------------------------------------------------------

    async def append_event(self, session_id: str, data: str) -> int:
        """Store one SSE payload (in memory now, in Redis soon after); returns its event id (1, 2, ...)."""
        events = self._events.setdefault(session_id, [])
        number = len(events) + 1
        events.append((number, data))
        self._notify()
        if session_id in self._unsynced_events:
            pass  # the write-through after Redis recovers sends it
        elif not self.link.up:
            self._unsynced_events[session_id] = number
        elif session_id not in self._tees:
            self._tees[session_id] = asyncio.create_task(self._tee(session_id))
        return number

    async def _tee(self, session_id: str) -> None:
        """Write the session's events Redis lacks, in order and in batches, until it has them all."""
        try:
            while True:
                async with self._write_lock(session_id):  # ids must reach Redis in order, write-through or not
                    stored = self._stored_events.get(session_id, 0)
                    pending = self._events.get(session_id, [])[stored:]
                    if not pending:
                        self._tees.pop(session_id, None)  # before any await: a later append starts a new tee
                        return
                    await self.link.run(lambda r, batch=pending: _add_events(r, session_id, batch))  # type: ignore[misc]
                    self._stored_events[session_id] = pending[-1][0]
        except RedisDown:
            self._unsynced_events.setdefault(session_id, self._stored_events.get(session_id, 0) + 1)
        finally:
            self._tees.pop(session_id, None)

    async def _flush_events(self, session_id: str) -> None:
        tee = self._tees.get(session_id)
        if tee is not None:
            await asyncio.gather(asyncio.shield(tee), return_exceptions=True)

    async def events_after(
        self, session_id: str, last_event: int, idle: float | None = None
    ) -> AsyncIterator[tuple[int, str] | None]:
        """Every event after ``last_event``, then the live tail until the session ends (or its replica is gone);
        with ``idle``, a ``None`` whenever that many seconds passed without an event (a keep-alive's cue)."""
        self._tailing[session_id] += 1  # keeps this replica's copy while it reads: no Redis read for the end
        try:
            async with contextlib.aclosing(self._tail(session_id, last_event, idle)) as tail:
                async for item in tail:
                    yield item
        finally:
            self._tailing[session_id] -= 1
            if self._tailing[session_id] <= 0:
                del self._tailing[session_id]
                if session_id in self._forget_after_tail:
                    self._forget_after_tail.discard(session_id)
                    self.forget(session_id)

    async def _tail(
        self, session_id: str, last_event: int, idle: float | None
    ) -> AsyncGenerator[tuple[int, str] | None, None]:
        quiet_since = time.monotonic()
        while True:
            batch = await self._read_events(session_id, last_event)
            for number, data in batch:
                yield number, data
                last_event = number
            if batch:
                quiet_since = time.monotonic()
                continue
            if await self._tail_ended(session_id):
                for number, data in await self._read_events(session_id, last_event):
                    yield number, data  # anything written between the last read and the end
                return
            if idle is not None and time.monotonic() - quiet_since >= idle:
                quiet_since = time.monotonic()
                yield None
            await self._wait_for_change(session_id, last_event)

    async def _tail_ended(self, session_id: str) -> bool:
        """Whether no event will follow: the session ended, or (run elsewhere) its replica stopped its heartbeat."""
        if session_id in self._events:  # run here: this replica's own record says, no Redis read needed
            local = self._records.get(session_id)
            return local is None or local.ended
        record = await self.get(session_id)
        return record is None or record.ended or record.stale(time.time())

    async def _read_events(self, session_id: str, last_event: int) -> list[tuple[int, str]]:
        local = self._events.get(session_id)
        if local is not None:  # this replica runs (or ran) it: its own copy is complete
            return local[last_event:]
        try:
            entries = await self.link.run(lambda r: r.xrange(_events_key(session_id), min=f"(0-{last_event}", max="+"))
        except RedisDown:
            return []
        return [(int(str(entry_id).split("-")[1]), str(fields["data"])) for entry_id, fields in entries or [] if fields]

    async def _wait_for_change(self, session_id: str, last_event: int) -> None:
        if session_id in self._events or not self.link.up:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TAIL_BLOCK_MS / 1000):
                    await self._changed.wait()
            return
        with contextlib.suppress(RedisDown):  # another replica writes it: block on the stream itself
            await self.link.run(
                lambda r: r.xread({_events_key(session_id): f"0-{last_event}"}, block=TAIL_BLOCK_MS, count=1)
            )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _prune(self, now: float) -> None:
        """Drop ended sessions past their TTL from memory (those Redis never got, while it was down)."""
        for session_id, record in list(self._records.items()):
            if record.ended and now - record.updated_at > self.ttl:
                self._records.pop(session_id, None)
                self._events.pop(session_id, None)
                self._unsynced_records.discard(session_id)
                self._unsynced_events.pop(session_id, None)
                self._write_locks.pop(session_id, None)
                self._stored_events.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        """Drop this replica's copy of an ended session once Redis holds it (and no reader here tails it: a reader
        woken by the end would otherwise read it all from Redis)."""
        synced = session_id not in self._unsynced_records and session_id not in self._unsynced_events
        if synced and session_id not in self._tees and self._tailing[session_id] > 0:
            self._forget_after_tail.add(session_id)
            return
        if synced and session_id not in self._tees:
            self._records.pop(session_id, None)
            self._events.pop(session_id, None)
            self._write_locks.pop(session_id, None)
            self._stored_events.pop(session_id, None)

    # -- cancellation ----------------------------------------------------------------------------------------------

    async def mark_reader(self, session_id: str) -> None:
        """Someone on this replica reads the session's stream (for the next ``READER_KEY_SECONDS``); raises
        ``RedisDown``."""
        await self.link.run(lambda r: r.set(_reader_key(session_id), "1", ex=READER_KEY_SECONDS))

    async def has_reader(self, session_id: str) -> bool:
        """Whether a reader on any replica marked itself lately; raises ``RedisDown``."""
        return bool(await self.link.run(lambda r: r.exists(_reader_key(session_id))))

    def on_cancel(self, callback: Callable[[str], None]) -> None:
        self._cancel_callbacks.append(callback)

    async def publish_cancel(self, session_id: str) -> None:
        """Cancel wherever it runs: locally at once, and on every other replica through Redis."""
        for callback in self._cancel_callbacks:
            callback(session_id)
        with contextlib.suppress(RedisDown):
            await self.link.run(lambda r: r.publish(CANCEL_CHANNEL, session_id))

    def start(self) -> None:
        if self.link.enabled:
            self._listener = asyncio.create_task(self._listen_for_cancels())

    async def _listen_for_cancels(self) -> None:
        while True:
            try:
                pubsub = self.link.client.pubsub()
                await pubsub.subscribe(CANCEL_CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        for callback in self._cancel_callbacks:
                            callback(str(message["data"]))
            except (RedisError, OSError, TimeoutError):
                await asyncio.sleep(1.0)  # Redis is down: resubscribe when it is back

    async def close(self) -> None:
        if self._tees:
            await asyncio.wait(set(self._tees.values()), timeout=5)
        await stop_task(self._listener)

    # -- recovery ----------------------------------------------------------------------------------------------------

    async def _write_through(self) -> None:
        """Write back everything held in memory: a Redis that restarted empty lost even what it had been sent."""
        for session_id in list(self._records):
            key = _events_key(session_id)
            async with self._write_lock(session_id):
                last = await self.link.run(lambda r, k=key: r.xrevrange(k, count=1))  # type: ignore[misc]
                stored = int(str(last[0][0]).split("-")[1]) if last else 0
                for number, data in self._events.get(session_id, [])[stored:]:
                    await self.link.run(lambda r, n=number, d=data, k=key: r.xadd(k, {"data": d}, id=f"0-{n}"))  # type: ignore[misc]
                    stored = number
                self._stored_events[session_id] = stored
                self._unsynced_events.pop(session_id, None)
                # The record after its events: an ended record's write also sets the events' expiry.
                await self._write_latest_locked(session_id)
                self._unsynced_records.discard(session_id)


async def _add_events(client: aioredis.Redis, session_id: str, events: list[tuple[int, str]]) -> None:
    async with client.pipeline(transaction=False) as pipe:
        for number, data in events:
            pipe.xadd(_events_key(session_id), {"data": data}, id=f"0-{number}")
        await pipe.execute()


def _parse(raw: str) -> SessionRecord | None:
    try:
        return SessionRecord.model_validate_json(raw)
    except ValidationError:
        logger.warning("ignoring a malformed session record in Redis")
        return None
