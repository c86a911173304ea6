"""What nodes announce in the DHT, and how readers get it back.

Keys: ``{model}.model`` holds a ``ModelRecord`` (subkey: the announcing peer); ``{model}.block.{i}`` holds one
``ServerRecord`` per peer serving block ``i`` (subkey: peer id); ``swarmgate.models`` holds every node's
``ModelRecord`` again, so a gateway whose model nobody serves can say which models the nodes do serve. Every
record expires; nodes re-announce periodically, and announce ``OFFLINE`` with a short expiration when they stop.
Records that fail validation are dropped on read, never trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from shared.membership import owner_subkey, peer_of_subkey
from shared.server_records import ModelRecord as ModelRecord
from shared.server_records import NodeState as NodeState
from shared.server_records import ServerRecord as ServerRecord
from shared.server_records import parse_server_entries as parse_server_entries
from shared.server_records import record_json as record_json

MODELS_KEY = "swarmgate.models"


def model_key(model: str) -> str:
    return f"{model}.model"


def block_key(model: str, block: int) -> str:
    return f"{model}.block.{block}"


async def announce(dht: DHT, model: ModelRecord, server: ServerRecord, expiration: float) -> None:
    """Store ``server`` under each of its blocks and the model record, all expiring in ``expiration`` seconds."""
    keys = [model_key(model.name), MODELS_KEY] + [block_key(model.name, i) for i in server.blocks]
    values: list[Any] = [model.model_dump(mode="json")] * 2 + [record_json(server)] * len(server.blocks)
    await dht.run_coroutine(
        partial(_store_many, keys=keys, values=values, subkey=owner_subkey(server.peer_id), expiration=expiration),
        return_future=True,
    )


async def _store_many(
    dht: DHT, node: DHTNode, *, keys: list[str], values: list[Any], subkey: bytes, expiration: float
) -> None:
    await node.store_many(keys, values, get_dht_time() + expiration, subkeys=[subkey] * len(keys))


async def fetch_model_record(dht: DHT, model: str) -> ModelRecord | None:
    found = await dht.get(model_key(model), latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return None
    for entry in found.value.values():
        try:
            return ModelRecord.model_validate(entry.value)
        except ValidationError:
            continue
    return None


async def fetch_announced_models(dht: DHT) -> list[str]:
    """Names of the models any node announces now, sorted."""
    found = await dht.get(MODELS_KEY, latest=True, return_future=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    names = set()
    for entry in entries.values():
        try:
            names.add(ModelRecord.model_validate(entry.value).name)
        except ValidationError:
            continue
    return sorted(names)


async def fetch_servers(dht: DHT, model: str, num_blocks: int) -> dict[str, ServerRecord]:
    """Every valid, unexpired server record for the model, by peer id."""
    return (await fetch_announcements(dht, model, num_blocks))[0]


async def fetch_block_servers(dht: DHT, model: str, blocks: Sequence[int]) -> dict[str, ServerRecord]:
    """The valid, unexpired records of the servers of ``blocks`` only, by peer id: one key per block, where
    ``fetch_servers`` reads every block's (a swarm of 1,000 nodes holds about 60 records under each)."""
    return (await _fetch(dht, model, blocks))[0]


async def fetch_announcements(
    dht: DHT, model: str, num_blocks: int
) -> tuple[dict[str, ServerRecord], dict[str, float]]:
    """``fetch_servers``, and each record's expiration time (DHT time): it grows with every announcement, so a
    reader can tell a node that announced again from the record it saw before."""
    return await _fetch(dht, model, range(num_blocks))


async def _fetch(dht: DHT, model: str, blocks: Sequence[int]) -> tuple[dict[str, ServerRecord], dict[str, float]]:
    keys = [block_key(model, i) for i in blocks]
    found = await dht.run_coroutine(partial(_get_many, keys=keys), return_future=True)
    servers = parse_server_entries([{peer: value for peer, (value, _) in entry.items()} for entry in found], blocks)
    stamps: dict[str, float] = {}
    for entry in found:
        for peer, (_, expiration) in entry.items():
            if peer in servers:
                stamps[peer] = max(stamps.get(peer, expiration), expiration)
    return servers, stamps


async def _get_many(dht: DHT, node: DHTNode, *, keys: list[str]) -> list[dict[str, tuple[Any, float]]]:
    results = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    entries = []
    for key in keys:
        found = results.get(key)
        values = found.value if found is not None and isinstance(found.value, dict) else {}
        latest: dict[str, tuple[Any, float]] = {}  # a restarted peer may have left a record under its old owner key
        for subkey, item in sorted(values.items(), key=lambda pair: pair[1].expiration_time):
            latest[peer_of_subkey(subkey)] = (item.value, float(item.expiration_time))
        entries.append(latest)
    return entries
