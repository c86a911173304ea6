"""API keys: created once and shown once, stored only as SHA-256 hashes, checked in constant time.

Keys look like ``sg-<key id>-<secret>``; Redis holds ``sg:apikey:{id}`` (JSON, with the hash) and
``sg:apikey-hash:{sha256}`` → id for lookup. A 32-byte random secret needs no slow hash: nothing can be guessed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from gateway.state.redis_link import RedisLink

KEY_SET = "sg:apikeys"


class KeyLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0)
    concurrent_streams: int | None = Field(None, gt=0)


class ApiKey(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    name: str
    hash: str
    admin: bool = False
    limits: KeyLimits = KeyLimits()
    created_at: float
    revoked: bool = False


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


class KeyStore:
    def __init__(self, link: RedisLink) -> None:
        self.link = link

    async def create(self, name: str, admin: bool = False, limits: KeyLimits | None = None) -> tuple[ApiKey, str]:
        """Returns the stored key and its plaintext (shown once, never stored)."""
        key_id = secrets.token_hex(6)
        plaintext = f"sg-{key_id}-{secrets.token_urlsafe(32)}"
        key = ApiKey(
            id=key_id,
            name=name,
            hash=hash_key(plaintext),
            admin=admin,
            limits=limits or KeyLimits(),
            created_at=time.time(),
        )

        async def write(client: Redis) -> None:
            async with client.pipeline(transaction=True) as pipe:
                pipe.set(f"sg:apikey:{key_id}", key.model_dump_json())
                pipe.set(f"sg:apikey-hash:{key.hash}", key_id)
                pipe.sadd(KEY_SET, key_id)
                await pipe.execute()

        await self.link.run(write)
        return key, plaintext

    async def list_keys(self) -> list[ApiKey]:
        async def read(client: Redis) -> list[ApiKey]:
            ids = sorted(str(i) for i in await client.smembers(KEY_SET))
            raws = await client.mget([f"sg:apikey:{i}" for i in ids]) if ids else []
            return [ApiKey.model_validate_json(str(raw)) for raw in raws if raw]

        keys: list[ApiKey] = await self.link.run(read)
        return sorted(keys, key=lambda k: k.created_at)

    async def revoke(self, key_id: str) -> bool:
        async def write(client: Redis) -> bool:
            raw = await client.get(f"sg:apikey:{key_id}")
            if raw is None:
                return False
            key = ApiKey.model_validate_json(str(raw))
            async with client.pipeline(transaction=True) as pipe:
                pipe.set(f"sg:apikey:{key_id}", key.model_copy(update={"revoked": True}).model_dump_json())
                pipe.delete(f"sg:apikey-hash:{key.hash}")
                await pipe.execute()
            return True

        revoked: bool = await self.link.run(write)
        return revoked

    async def authenticate(self, presented: str) -> ApiKey | None:
        """The live key ``presented`` names, or None."""
        digest = hash_key(presented)

        async def read(client: Redis) -> str | None:
            key_id = await client.get(f"sg:apikey-hash:{digest}")
            raw = await client.get(f"sg:apikey:{key_id!s}") if key_id else None
            return str(raw) if raw is not None else None

        raw = await self.link.run(read)
        if raw is None:
            return None
        key = ApiKey.model_validate_json(raw)
        # The lookup already matched; the constant-time comparison keeps timing independent of where hashes differ.
        if key.revoked or not hmac.compare_digest(key.hash, digest):
            return None
        return key
