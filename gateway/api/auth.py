"""Who is calling: ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``) checked against the operator's
keys and those in Redis.

Authentication is on or off because the operator said so (``gateway serve --auth keys|none``; on by default beyond
loopback), fixed at start: nothing Redis holds or loses can open the gateway. With it off every caller is the
anonymous admin (the local demo). With it on:

- no key, or a malformed header: 401 ``invalid_api_key``;
- an operator key (``--admin-key``, ``--admin-key-file``, ``--api-keys``): admin, checked in memory, no Redis needed;
- any other key is looked up in Redis: unknown or revoked there (an emptied Redis included) is 401;
- while Redis is down, a key it confirmed within ``CONFIRMED_TTL`` is still accepted from this replica's memory;
  any other key is refused with 503 ``auth_unavailable`` (retry later: nobody can vouch for it now).

Keys are compared as SHA-256 digests in constant time; plaintext is never stored or logged.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from gateway.api.errors import ServiceUnavailable, Unauthorized
from gateway.state.api_keys import ApiKey, KeyLimits, KeyStore, hash_key
from gateway.state.redis_link import RedisDown

logger = logging.getLogger(__name__)

CONFIRMED_TTL = 600.0  # seconds a key Redis confirmed stays valid from memory while Redis is down


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
    def __init__(self, operator_keys: list[str], store: KeyStore | None, enabled: bool) -> None:
        """``enabled`` False: every caller is ``ANONYMOUS``; the keys are then ignored (settings refuse both)."""
        # The operator's keys are admins with no limits; their id is a digest prefix, so logs never show the key.
        self._operators = {hash_key(key): Caller(f"op-{hash_key(key)[:12]}", admin=True) for key in operator_keys}
        self._store = store
        self.enabled = enabled
        self._confirmed: dict[str, tuple[ApiKey, float]] = {}  # digest -> (key Redis confirmed, monotonic time)

    async def caller(self, authorization: str | None) -> Caller:
        if not self.enabled:
            return ANONYMOUS
        presented = _bearer(authorization)
        if presented is None:
            raise Unauthorized(
                "You didn't provide an API key. Send it in the Authorization header as 'Bearer KEY' (or as x-api-key).",
                "invalid_api_key",
            )
        digest = hash_key(presented)
        for known_digest, caller in self._operators.items():
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
            return self._remembered(digest)
        if key is None:
            self._confirmed.pop(digest, None)
        else:
            self._confirmed[digest] = (key, time.monotonic())
        return key

    def _remembered(self, digest: str) -> ApiKey:
        """A key Redis confirmed lately, while Redis cannot answer; anything else is refused until it can."""
        remembered = self._confirmed.get(digest)
        if remembered is not None and time.monotonic() - remembered[1] < CONFIRMED_TTL:
            return remembered[0]
        raise ServiceUnavailable(
            "API keys cannot be checked right now (the key store is unreachable); retry shortly.", "auth_unavailable"
        )


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
    authorization = request.headers.get("authorization")
    api_key = request.headers.get("x-api-key", "").strip()
    if not authorization and api_key:  # Anthropic's SDKs send the key this way
        authorization = f"Bearer {api_key}"
    return await authenticator.caller(authorization)


CallerDep = Annotated[Caller, Depends(authenticate)]
