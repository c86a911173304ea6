"""What a node announces, as plain data: its server record and its model's record, and how a reader validates what
it found under each block (pure: no DHT, no I/O; ``dht_records`` stores and fetches them)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger(__name__)


class Reachability(StrEnum):
    """How peers reach a node (decided by ``shared.reachability``'s dial-back check)."""

    DIRECT = "direct"
    RELAYED = "relayed"
    UNREACHABLE = "unreachable"


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


# A measured round trip in seconds: finite and not negative (a record is a stranger's word: NaN would poison every
# sum the route search makes, a negative one would pull routes through its sender).
RoundTrip = Annotated[float, Field(ge=0)]


class ServerRecord(BaseModel):
    """One node's announcement; the same record is stored under every block of its span."""

    # allow_inf_nan=False: a record announcing an infinite throughput (or a NaN anything) would draw every route to
    # its sender or break the search's comparisons; such a record is dropped as malformed.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    peer_id: str
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    state: NodeState
    throughput: float = Field(0.0, ge=0)  # decode tokens/s one session gets through the whole span
    prefill_throughput: float = Field(0.0, ge=0)  # prompt tokens/s through the whole span
    # Tokens of the KV pool left, over the whole span: a session over k of the span's n blocks takes max_length x k / n.
    cache_tokens_left: int = Field(0, ge=0)
    # The node's whole KV-cache pool: the longest session it can ever hold (0: not said, an older node).
    cache_tokens_total: int = Field(0, ge=0)
    queue_depth: int = Field(0, ge=0)  # steps waiting for the compute thread when announced
    # Seconds to the nodes that serve our `end` block (swarm_node.next_hops measures 4).
    next_rtts: dict[str, RoundTrip] = Field(default_factory=dict, max_length=64)
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
    # Where a DRAINING node is moving (the new span's first block; its length stays): nodes choosing a span count it
    # there already (``swarm_node.span_choice``), so that those checking while it drains and loads do not all take
    # the same gap. Announced only when set, like ``adapters``.
    moving_to: int | None = Field(None, ge=0)
    version: str
    protocol: int

    @property
    def block_time(self) -> float:
        """Seconds one decode token spends in each block of this node (infinite when unmeasured)."""
        return 1.0 / (self.throughput * (self.end - self.start)) if self.throughput > 0 else float("inf")

    @property
    def occupancy(self) -> float:
        """The share of the KV pool in use, in tenths (a coarse signal: a record is up to 10 s old); 0 where the
        pool's size is not said."""
        if self.cache_tokens_total <= 0:
            return 0.0
        return round(min(1.0, max(0.0, 1.0 - self.cache_tokens_left / self.cache_tokens_total)), 1)

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)

    def covers(self, start: int, end: int) -> bool:
        """Whether this node serves every block of [start, end)."""
        return self.start <= start and end <= self.end


def record_json(server: ServerRecord) -> dict[str, Any]:
    """The record as stored: fields added since the first release left out while unset, so older readers (which
    forbid unknown fields) still accept a record that uses none of them."""
    data = server.model_dump(mode="json")
    if not server.adapters:
        del data["adapters"]
    if server.precision is None:
        del data["precision"]
    if server.moving_to is None:
        del data["moving_to"]
    return data


def parse_server_entries(
    entries: Sequence[dict[str, Any]], blocks: Sequence[int] | None = None
) -> dict[str, ServerRecord]:
    """``entries[i]`` holds the records stored under block ``blocks[i]`` (default: block ``i``), by subkey.

    A record is kept only if its owner stored it (subkey == peer id) and its span covers the block it was found
    under: after a node moves, records left under its old blocks name the new span and are ignored there.
    """
    servers: dict[str, ServerRecord] = {}
    for block, entry in zip(range(len(entries)) if blocks is None else blocks, entries, strict=True):
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
