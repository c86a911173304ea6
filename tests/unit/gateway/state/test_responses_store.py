"""Stored responses: shared through a real redis-server (two stores = two replicas), held in memory without one."""

from __future__ import annotations

from gateway.state.redis_link import RedisLink
from gateway.state.responses_store import ResponseStore, StoredResponse
from tests.helpers.redis_server import RedisServer


def stored(text: str) -> StoredResponse:
    return StoredResponse(key_id="k1", response={"id": "resp_1", "status": "completed", "text": text}, messages=[])


async def test_a_response_saved_on_one_replica_is_read_and_deleted_on_another(redis_server: RedisServer) -> None:
    links = [RedisLink(redis_server.url), RedisLink(redis_server.url)]
    a, b = (ResponseStore(link, ttl=60) for link in links)
    try:
        await a.save("resp_1", stored("hi"))
        assert await b.get("resp_1") == stored("hi")
        ttl = await links[0].run(lambda r: r.ttl("sg:response:resp_1"))
        assert 0 < ttl <= 60
        assert await b.delete("resp_1")
        assert await a.get("resp_1") is None  # Redis is the truth: a's memory copy does not resurrect it
        assert not await b.delete("resp_1")
    finally:
        for link in links:
            await link.close()


async def test_without_redis_responses_live_in_memory_until_their_ttl() -> None:
    link = RedisLink(None)
    store = ResponseStore(link, ttl=60)
    await store.save("resp_1", stored("hi"))
    assert await store.get("resp_1") == stored("hi")
    expired = ResponseStore(link, ttl=-1)  # already past its time
    await expired.save("resp_2", stored("x"))
    assert await expired.get("resp_2") is None
    assert await store.delete("resp_1") and await store.get("resp_1") is None
    await link.close()
