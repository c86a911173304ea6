"""Authentication and quotas against a real, private redis-server that a test stops, restarts empty, or loses.

Nothing Redis holds or loses opens the gateway: an emptied Redis refuses every key it no longer knows (401); a
Redis that cannot answer refuses keys it never confirmed (503 ``auth_unavailable``) and nobody becomes admin.
Quotas split between the replicas Redis last counted, so they do not multiply without ``--replicas``.
"""

from __future__ import annotations

import pytest

from gateway.api.auth import Authenticator
from gateway.api.errors import ServiceUnavailable, Unauthorized
from gateway.state.api_keys import KeyLimits, KeyStore
from gateway.state.quotas import QuotaExceeded, QuotaLimiter
from gateway.state.redis_link import RedisLink
from gateway.state.replicas import ReplicaCensus
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)


OPERATOR_KEY = "sk-operator-key"


def bearer(key: str) -> str:
    return f"Bearer {key}"


@pytest.fixture
def store(link: RedisLink) -> KeyStore:
    return KeyStore(link)


@pytest.fixture
def auth(store: KeyStore) -> Authenticator:
    """Keys required (fail closed), with one operator key given at start."""
    return Authenticator([OPERATOR_KEY], store, enabled=True)


async def test_redis_restarted_empty_refuses_every_key_it_lost_and_opens_nothing(
    store: KeyStore, auth: Authenticator, redis_server: RedisServer
) -> None:
    _, user = await store.create("user")
    _, admin = await store.create("root", admin=True)
    assert (await auth.caller(bearer(user))).admin is False
    assert (await auth.caller(bearer(admin))).admin is True
    redis_server.stop()
    redis_server.start()  # the same port, nothing on disk: every key is gone
    for presented in (None, bearer(user), bearer(admin), bearer("sk-made-up")):
        with pytest.raises(Unauthorized):
            await auth.caller(presented)
    operator = await auth.caller(bearer(OPERATOR_KEY))  # the operator's key needs no Redis
    assert operator.admin and operator.key_id is not None and operator.key_id.startswith("op-")


async def test_while_redis_is_down_only_keys_it_confirmed_pass_and_others_get_503(
    store: KeyStore, auth: Authenticator, redis_server: RedisServer
) -> None:
    _, confirmed = await store.create("confirmed")
    _, never_seen = await store.create("never-seen")
    await auth.caller(bearer(confirmed))
    redis_server.stop()
    assert (await auth.caller(bearer(confirmed))).admin is False  # served from this replica's memory
    for presented in (bearer(never_seen), bearer("sk-made-up")):
        with pytest.raises(ServiceUnavailable) as refused:
            await auth.caller(presented)
        assert refused.value.code == "auth_unavailable" and refused.value.status == 503
    with pytest.raises(Unauthorized):
        await auth.caller(None)  # no key is 401 whatever Redis does
    assert (await auth.caller(bearer(OPERATOR_KEY))).admin


async def test_quotas_split_between_the_replicas_redis_counted_without_the_flag(
    link: RedisLink, redis_server: RedisServer
) -> None:
    other_link = RedisLink(redis_server.url)
    mine, other = ReplicaCensus(link, "A"), ReplicaCensus(other_link, "B")  # --replicas left at 1
    try:
        await mine.beat()
        await other.beat()
        await mine.beat()
        assert mine.count == 2
        limiter = QuotaLimiter(link, census=mine)
        redis_server.stop()
        admitted = 0
        for _ in range(8):
            try:
                ticket = await limiter.admit("k", KeyLimits(requests_per_minute=10), 1)
            except QuotaExceeded:
                continue
            admitted += 1
            await limiter.release(ticket, 1)
        assert admitted == 5  # this replica's half, not the whole limit
        # A limit smaller than the replica count is refused while Redis is away, never unlimited.
        with pytest.raises(QuotaExceeded, match="concurrent streams"):
            await limiter.admit("s", KeyLimits(concurrent_streams=1), 1)
    finally:
        await other_link.close()


async def test_a_replica_that_leaves_stops_counting(link: RedisLink, redis_server: RedisServer) -> None:
    other_link = RedisLink(redis_server.url)
    mine, other = ReplicaCensus(link, "A", configured=1), ReplicaCensus(other_link, "B")
    await mine.beat()
    await other.beat()
    await mine.beat()
    assert mine.count == 2
    await other.close()  # a clean stop removes its entry at once
    await other_link.close()
    await mine.beat()
    assert mine.count == 1
    assert ReplicaCensus(link, "C", configured=3).count == 3  # --replicas is a floor
