"""Session records, event streams, cancellation, API keys and quotas against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from gateway.state.api_keys import KeyLimits, KeyStore, hash_key
from gateway.state.quotas import QuotaExceeded, QuotaLimiter
from gateway.state.redis_link import RedisLink
from gateway.state.store import SessionStatus, SessionStore
from tests.helpers.polling import eventually
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)


async def test_records_are_listed_per_key_and_expire_after_the_end(link: RedisLink) -> None:
    replica_a, replica_b = SessionStore(link, "A", ttl=1), SessionStore(RedisLink(link.url), "B", ttl=1)
    first = replica_a.new_record("s1", "m", "key1", prompt_tokens=5)
    await replica_a.save(first)
    await replica_a.save(replica_a.new_record("s2", "m", "key2", prompt_tokens=3))
    assert [r.id for r in await replica_b.list_sessions("key1")] == ["s1"]
    assert {r.id for r in await replica_b.list_sessions(None)} == {"s1", "s2"}
    assert (await replica_b.get("s1")) == first
    updated = await replica_a.update("s1", status=SessionStatus.FINISHED, completion_tokens=7, finish_reason="stop")
    assert updated is not None and updated.ended
    replica_a.forget("s1")

    async def expired() -> bool:
        return await replica_b.get("s1") is None

    await eventually(expired, within=10)  # ttl 1 s
    assert [r.id for r in await replica_b.list_sessions(None)] == ["s2"]
    await replica_b.link.close()


async def test_events_resume_after_any_id_then_follow_the_live_tail_on_another_replica(link: RedisLink) -> None:
    writer, reader = SessionStore(link, "A"), SessionStore(RedisLink(link.url), "B")
    await writer.save(writer.new_record("s", "m", None, 1))
    for i in range(3):
        await writer.append_event("s", f"chunk{i}")

    async def finish_later() -> None:
        await asyncio.sleep(0.3)
        await writer.append_event("s", "chunk3")
        await writer.append_event("s", "[DONE]")
        await writer.update("s", status=SessionStatus.FINISHED)

    task = asyncio.create_task(finish_later())
    got = [event async for event in reader.events_after("s", last_event=1)]
    await task
    assert got == [(2, "chunk1"), (3, "chunk2"), (4, "chunk3"), (5, "[DONE]")]
    await reader.link.close()


async def test_a_session_forgotten_while_read_here_ends_from_memory_then_is_dropped(link: RedisLink) -> None:
    store = SessionStore(link, "A")
    await store.save(store.new_record("s", "m", None, 1))
    await store.append_event("s", "chunk0")
    tail = store.events_after("s", last_event=0)
    assert await anext(tail) == (1, "chunk0")  # the reader waits for more, here
    await store.append_event("s", "[DONE]")
    await store.update("s", status=SessionStatus.FINISHED)
    store.forget("s")  # what a session's end does: the local reader still tails it
    await store._flush_events("s")
    await link.client.flushdb()  # so any read of Redis would miss the end: the reader must take it from memory
    assert [event async for event in tail] == [(2, "[DONE]")]
    assert await store.get("s") is None  # dropped once its reader was done (and Redis no longer has it)


async def test_a_cancel_published_on_one_replica_reaches_the_other(link: RedisLink) -> None:
    runner, other = SessionStore(link, "A"), SessionStore(RedisLink(link.url), "B")
    cancelled: asyncio.Queue[str] = asyncio.Queue()
    runner.on_cancel(cancelled.put_nowait)
    runner.start()

    async def subscribed() -> bool:
        return dict(await link.client.pubsub_numsub("sg:cancel")).get("sg:cancel", 0) > 0

    await eventually(subscribed, within=10)
    await other.publish_cancel("s42")
    assert await asyncio.wait_for(cancelled.get(), 5) == "s42"
    await runner.close()
    await other.link.close()


async def test_outage_keeps_serving_from_memory_and_writes_through_on_recovery(
    link: RedisLink, redis_server: RedisServer
) -> None:
    store = SessionStore(link, "A")
    await store.save(store.new_record("s", "m", None, 1))
    await store.append_event("s", "before")
    redis_server.freeze()
    try:
        await store.append_event("s", "during")  # at most the socket timeout, then memory
        await store.update("s", completion_tokens=2)
        assert not link.up
        assert (await store.get("s")).completion_tokens == 2  # type: ignore[union-attr]
    finally:
        redis_server.thaw()
    for _ in range(50):
        if link.up and not store._unsynced_events:
            break
        await asyncio.sleep(0.1)
    other = SessionStore(RedisLink(link.url), "B")
    assert (await other.get("s")).completion_tokens == 2  # type: ignore[union-attr]
    await store.update("s", status=SessionStatus.FINISHED)
    assert [e async for e in other.events_after("s", 0)] == [(1, "before"), (2, "during")]
    await other.link.close()


async def test_keys_are_stored_only_as_hashes_and_revocation_works(link: RedisLink) -> None:
    keys = KeyStore(link)
    key, plaintext = await keys.create("alice", limits=KeyLimits(requests_per_minute=5))
    assert (await keys.authenticate(plaintext)) == key
    assert await keys.authenticate(plaintext + "x") is None
    everything = []
    async for name in link.client.scan_iter("*"):
        everything.append(name)
        kind = await link.client.type(name)
        if kind == "string":
            everything.append(await link.client.get(name))
    assert plaintext not in " ".join(map(str, everything)) and hash_key(plaintext) in " ".join(map(str, everything))
    assert [k.id for k in await keys.list_keys()] == [key.id]
    assert await keys.revoke(key.id)
    assert await keys.authenticate(plaintext) is None


class Clock:
    """Wall-clock seconds that move only when the test says: no count straddles a minute's edge by chance."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_each_limit_trips_at_exactly_its_count_even_under_concurrency(link: RedisLink) -> None:
    limiter = QuotaLimiter(link, clock=Clock(1_800_000_000.0))
    limits = KeyLimits(requests_per_minute=10)
    results = await asyncio.gather(*(limiter.admit("k1", limits, 1) for _ in range(25)), return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in results) == 10
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(refused) == 15 and refused[0].limit == "requests per minute" and 0 < refused[0].retry_after <= 60

    tokens = KeyLimits(tokens_per_minute=100)
    tickets = [await limiter.admit("k2", tokens, 40), await limiter.admit("k2", tokens, 40)]
    with pytest.raises(QuotaExceeded, match="tokens per minute"):
        await limiter.admit("k2", tokens, 40)
    await limiter.release(tickets[0], used_tokens=10)  # 30 unused tokens come back
    await limiter.admit("k2", tokens, 20)

    streams = KeyLimits(concurrent_streams=2)
    held = [await limiter.admit("k3", streams, 1) for _ in range(2)]
    with pytest.raises(QuotaExceeded, match="concurrent streams") as refused_stream:
        await limiter.admit("k3", streams, 1)
    assert refused_stream.value.retry_after == 1
    await limiter.release(held[0], 1)
    await limiter.admit("k3", streams, 1)


async def test_a_minute_limit_resets_with_the_next_calendar_minute(link: RedisLink) -> None:
    clock = Clock(1_800_000_000.0 + 45)  # 45 s into a minute
    limiter = QuotaLimiter(link, clock=clock)
    limits = KeyLimits(requests_per_minute=2)
    for _ in range(2):
        await limiter.admit("k", limits, 1)
    with pytest.raises(QuotaExceeded) as refused:
        await limiter.admit("k", limits, 1)
    assert refused.value.retry_after == 15  # the seconds left in this minute
    clock.now += 15
    await limiter.admit("k", limits, 1)  # a new minute, a new count


async def test_quotas_without_redis_are_split_between_replicas(link: RedisLink, redis_server: RedisServer) -> None:
    limiter = QuotaLimiter(link, replicas=2)
    redis_server.stop()
    limits = KeyLimits(requests_per_minute=10)
    results = [await _admitted(limiter, limits) for _ in range(8)]
    assert results.count(True) == 5  # this replica's half of the limit


async def _admitted(limiter: QuotaLimiter, limits: KeyLimits) -> bool:
    try:
        await limiter.admit("k", limits, 1)
    except QuotaExceeded:
        return False
    return True


async def test_what_was_written_while_redis_was_down_is_read_back_before_the_write_through_reaches_it(
    link: RedisLink, redis_server: RedisServer
) -> None:
    """Redis reads as up again before the write-through has written what memory held: a read in between gets the
    newer copy from memory, not Redis's older one."""
    held, release = asyncio.Event(), asyncio.Event()

    async def hold_the_write_through() -> None:  # runs before the store's own write-through (registered first)
        held.set()
        await release.wait()

    link.on_recovery(hold_the_write_through)
    store = SessionStore(link, "A")
    await store.save(store.new_record("s", "m", "k", 1))
    redis_server.freeze()
    try:
        assert not await link.probe()  # marked down: the update below is never sent (a frozen Redis runs what it got)
        await store.update("s", status=SessionStatus.FINISHED)
    finally:
        redis_server.thaw()
    await asyncio.wait_for(held.wait(), timeout=15)
    try:
        assert link.up
        assert (await store.get("s")).status == SessionStatus.FINISHED  # type: ignore[union-attr]
        assert [rec.status for rec in await store.list_sessions("k")] == [SessionStatus.FINISHED]
        assert [rec.status for rec in await store.list_sessions(None)] == [SessionStatus.FINISHED]
    finally:
        release.set()
    await eventually(lambda: not store._unsynced_records, within=15)
    other = SessionStore(RedisLink(link.url), "B")
    assert (await other.get("s")).status == SessionStatus.FINISHED  # type: ignore[union-attr]
    await other.link.close()
