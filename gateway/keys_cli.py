"""`gateway keys create|list|revoke`: API keys in the gateways' Redis."""

from __future__ import annotations

import sys
from datetime import UTC, datetime

from gateway.settings import KeyCreateSettings, KeyListSettings, KeyRevokeSettings, RedisSettings
from gateway.state.api_keys import ApiKey, KeyLimits, KeyStore
from gateway.state.redis_link import RedisDown, RedisLink


class KeysCommandError(Exception):
    """The command could not do its work (no Redis, unknown key)."""


async def run(settings: RedisSettings) -> None:
    if not settings.redis_url:
        raise KeysCommandError("API keys live in Redis: give --redis-url (or SWARMGATE_REDIS_URL)")
    link = RedisLink(settings.redis_url)
    try:
        store = KeyStore(link)
        if isinstance(settings, KeyCreateSettings):
            await _create(store, settings)
        elif isinstance(settings, KeyRevokeSettings):
            if not await store.revoke(settings.key_id):
                raise KeysCommandError(f"no API key with id {settings.key_id!r}")
            sys.stderr.write(f"revoked {settings.key_id}\n")
        elif isinstance(settings, KeyListSettings):
            _print_table(await store.list_keys())
    except RedisDown:
        raise KeysCommandError(f"cannot reach Redis at {settings.redis_url}") from None
    finally:
        await link.close()


async def _create(store: KeyStore, settings: KeyCreateSettings) -> None:
    limits = KeyLimits(
        requests_per_minute=settings.requests_per_minute,
        tokens_per_minute=settings.tokens_per_minute,
        concurrent_streams=settings.concurrent_streams,
    )
    key, plaintext = await store.create(settings.name, settings.admin, limits)
    sys.stderr.write(f"created key {key.id} ({key.name}); it is shown only now, store it safely:\n")
    sys.stdout.write(plaintext + "\n")


def _print_table(keys: list[ApiKey]) -> None:
    rows = [("ID", "NAME", "ADMIN", "RPM", "TPM", "STREAMS", "CREATED (UTC)", "STATUS")]
    for key in keys:
        limits = key.limits
        rows.append(
            (
                key.id,
                key.name,
                "yes" if key.admin else "no",
                str(limits.requests_per_minute or "-"),
                str(limits.tokens_per_minute or "-"),
                str(limits.concurrent_streams or "-"),
                datetime.fromtimestamp(key.created_at, UTC).strftime("%Y-%m-%d %H:%M"),
                "revoked" if key.revoked else "active",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        sys.stdout.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")
