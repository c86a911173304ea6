"""Who is calling: ``Authorization: Bearer KEY`` checked against the operator's keys and those in Redis.

Authentication is on when the operator gave keys (``--api-keys``), asked for it (``--require-api-key``), or any key
was created with ``gateway keys create``; otherwise the gateway is open (the local demo) and every caller is the
anonymous admin. Keys are compared as SHA-256 digests in constant time; plaintext is never stored or logged.

While Redis is down, keys it confirmed before are still accepted from this replica's memory (revocations reach it
when Redis is back), and whether authentication is on keeps its last known answer.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from gateway.api.errors import Unauthorized
from gateway.sessions.api_keys import ApiKey, KeyLimits, KeyStore, hash_key
from gateway.sessions.redis_link import RedisDown

logger = logging.getLogger(__name__)

KEYS_EXIST_TTL = 2.0  # seconds the "any key created?" answer is reused: one Redis read per request is plenty


@dataclass(frozen=True)
class Caller:
    key_id: str | None  # None: authentication is off
    admin: bool  # sees every session, not only its own
    limits: KeyLimits = KeyLimits()

    @property
    def scope(self) -> str:
        """What the caller's sessions are filed under (and multi-turn reuse is confined to)."""
        return self.key_id or "anonymous"


ANONYMOUS = Caller(key_id=None, admin=True)


class Authenticator:
    def __init__(self, static_keys: list[str], store: KeyStore | None, required: bool) -> None:
        # The operator's keys are admins with no limits; their id is a digest prefix, so logs never show the key.
        self._static = {hash_key(key): Caller(f"op-{hash_key(key)[:12]}", admin=True) for key in static_keys}
        self._store = store
        self._required = required
        self._keys_exist: tuple[bool, float] = (False, 0.0)  # (answer, monotonic time read)
        self._confirmed: dict[str, ApiKey] = {}  # digest -> key Redis confirmed (served while it is down)

    async def enabled(self) -> bool:
        if self._required or self._static:
            return True
        if self._store is None:
            return False
        known, read_at = self._keys_exist
        if time.monotonic() - read_at < KEYS_EXIST_TTL:
            return known
        try:
            known = await self._store.any_keys()
        except RedisDown:
            return known  # the last answer stands while Redis is away
        self._keys_exist = (known, time.monotonic())
        return known

    async def caller(self, authorization: str | None) -> Caller:
        if not await self.enabled():
            return ANONYMOUS
        presented = _bearer(authorization)
        if presented is None:
            raise Unauthorized(
                "You didn't provide an API key. Send it in the Authorization header as 'Bearer KEY'.",
                "invalid_api_key",
            )
        digest = hash_key(presented)
        for known_digest, caller in self._static.items():
            if hmac.compare_digest(known_digest, digest):
                return caller
        key = await self._stored_key(presented, digest)
        if key is None:
            raise Unauthorized("Incorrect API key provided.", "invalid_api_key")
        return Caller(key.id, key.admin, key.limits)

    async def _stored_key(self, presented: str, digest: str) -> ApiKey | None:
        if self._store is None:
            return None
        try:
            key = await self._store.authenticate(presented)
        except RedisDown:
            return self._confirmed.get(digest)
        if key is None:
            self._confirmed.pop(digest, None)
        else:
            self._confirmed[digest] = key
        return key


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


async def authenticate(request: Request) -> Caller:
    authenticator = request.app.state.authenticator
    if not isinstance(authenticator, Authenticator):
        raise RuntimeError("the app was built without its authenticator (use gateway.app.create_app)")
    return await authenticator.caller(request.headers.get("authorization"))


CallerDep = Annotated[Caller, Depends(authenticate)]
