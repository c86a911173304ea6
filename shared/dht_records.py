"""What nodes announce in the DHT, and how readers get it back.

Keys: ``{model}.model`` holds a ``ModelRecord`` (subkey: the announcing peer); ``{model}.block.{i}`` holds one
``ServerRecord`` per peer serving block ``i`` (subkey: peer id); ``swarmgate.models`` holds every node's
``ModelRecord`` again, so a gateway whose model nobody serves can say which models the nodes do serve. Every
record expires; nodes re-announce periodically, and announce ``OFFLINE`` with a short expiration when they stop.
Records that fail validation are dropped on read, never trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import StrEnum
from functools import partial
from typing import Any

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.membership import owner_subkey, peer_of_subkey
from shared.reachability import Reachability

logger = logging.getLogger(__name__)


class NodeState(StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    DRAINING = "draining"
    OFFLINE = "offline"


class ModelRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    num_blocks: int = Field(gt=0)
    family: str
    dtype: str


class ServerRecord(BaseModel):
    """One node's announcement; the same record is stored under every block of its span."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_id: str
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    state: NodeState
    throughput: float = Field(0.0, ge=0)  # decode tokens/s one session gets through the whole span
    prefill_throughput: float = Field(0.0, ge=0)  # prompt tokens/s through the whole span
    cache_tokens_left: int = Field(0, ge=0)
    # The node's whole KV-cache pool: the longest session it can ever hold (0: not said, an older node).
    cache_tokens_total: int = Field(0, ge=0)
    queue_depth: int = Field(0, ge=0)  # steps waiting for the compute thread when announced
    next_rtts: dict[str, float] = Field(default_factory=dict)  # seconds to the nodes that serve our `end` block
    # How peers reach the node (shared.reachability): directly, through a relay (dial relay_addrs first), or not at
    # all (it announces itself so operators see it, but nobody routes to it).
    reachability: Reachability = Reachability.DIRECT
    relay_addrs: list[str] = Field(default_factory=list, max_length=8)
    # LoRA adapters a session may name (``OpenSession.adapter``), for every block of the span. Announced only when
    # set (``record_json``), so a node without adapters announces what gateways before adapters can read.
    adapters: list[str] = Field(default_factory=list, max_length=64)
    # How the node computes: "quant/dtype/device", e.g. "nf4/bfloat16/cuda" (gateway.swarm.verify.tolerances picks
    # how far its outputs may differ from a replica's by it). Announced only when set, like ``adapters``.
    precision: str | None = Field(None, max_length=64)
    version: str
    protocol: int

    @property
    def block_time(self) -> float:
        """Seconds one decode token spends in each block of this node (infinite when unmeasured)."""
        return 1.0 / (self.throughput * (self.end - self.start)) if self.throughput > 0 else float("inf")

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)


MODELS_KEY = "swarmgate.models"


def record_json(server: ServerRecord) -> dict[str, Any]:
    """The record as stored: fields added since the first release left out while unset, so older readers (which
    forbid unknown fields) still accept a record that uses none of them."""
    data = server.model_dump(mode="json")
    if not server.adapters:
        del data["adapters"]
    if server.precision is None:
        del data["precision"]
    return data


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


async def fetch_announcements(
    dht: DHT, model: str, num_blocks: int
) -> tuple[dict[str, ServerRecord], dict[str, float]]:
    """``fetch_servers``, and each record's expiration time (DHT time): it grows with every announcement, so a
    reader can tell a node that announced again from the record it saw before."""
    keys = [block_key(model, i) for i in range(num_blocks)]
    found = await dht.run_coroutine(partial(_get_many, keys=keys), return_future=True)
    servers = parse_server_entries([{peer: value for peer, (value, _) in entry.items()} for entry in found])
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


def parse_server_entries(entries: Sequence[dict[str, Any]]) -> dict[str, ServerRecord]:
    """``entries[i]`` holds the records stored under block ``i``, by subkey.

    A record is kept only if its owner stored it (subkey == peer id) and its span covers the block it was found
    under: after a node moves, records left under its old blocks name the new span and are ignored there.
    """
    servers: dict[str, ServerRecord] = {}
    for block, entry in enumerate(entries):
        for subkey, value in entry.items():
            try:
                record = ServerRecord.model_validate(value)
            except ValidationError:
                logger.warning("dropping a malformed server record from %s", subkey)
                continue
            if record.peer_id != subkey:
                logger.warning("dropping a server record of %s stored by %s", record.peer_id, subkey)
                continue
            if record.start <= block < record.end:
                servers[record.peer_id] = record
    return servers
