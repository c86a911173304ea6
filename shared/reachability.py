"""Can other peers dial this node? A dial-back check at start, and the paths that reach relayed nodes.

A volunteer behind a home router can dial out but nobody can dial in. libp2p's answer is a circuit relay (v2): the
node reserves a slot on a reachable peer and others reach it at ``RELAY/p2p-circuit/p2p/NODE``. hivemind's p2pd
does the relaying; what it does not tell us is whether a node *needs* it, so we ask:

    node ──DialBack(addrs)──▶ helper (a bootstrap peer or a reachable node)
                               helper starts a throw-away libp2p host (no listening, no relay service, its own
                               identity, so an existing connection cannot fake the answer) and dials each address
    node ◀──DialBackResult───  which addresses answered

Verdicts (announced in the node's ``ServerRecord``): ``direct`` (a listen address answered), ``relayed`` (after
reserving a relay slot, the circuit address answered), ``unreachable`` (neither; the node is not counted as
coverage). A caller reaches a relayed node by dialling its circuit addresses once (``open_path``); p2pd keeps that
connection and reuses it for every stream.

The helper dials only addresses on the IP the request came from (a NAT'd node's private address is not, so it is
answered unreachable without a dial) and circuits through itself, so the check cannot aim it at third parties.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Sequence

import base58
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.server_records import Reachability as Reachability  # the verdict is a field of every server record

logger = logging.getLogger(__name__)

DIALBACK_HANDLER = "swarmgate.dialback"
DIAL_TIMEOUT = 5.0  # seconds the helper gives one address
MAX_DIALBACK_ADDRS = 8
DIALBACK_ANSWER_TIMEOUT = 30.0  # the helper starts a p2pd and dials: seconds, not milliseconds


class DialBack(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    addrs: list[str] = Field(max_length=MAX_DIALBACK_ADDRS)


class DialBackResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reached: list[str]


class _RawMaddr:
    """A multiaddr as p2pd's wire wants it (what ``connect`` sends is ``to_bytes()``)."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def to_bytes(self) -> bytes:
        return self._raw


def maddr_bytes(text: str) -> bytes:
    """The binary multiaddr of ``text``, with ``/p2p/ID`` as a raw multihash.

    hivemind's bundled multiaddr encodes ``/p2p/`` as a CIDv1, which p2pd's Go parser rejects ("length greater than
    remaining number of bytes"): relay circuits are the first addresses we hand p2pd in binary, so we encode that
    component ourselves and let the library do the rest.
    """
    out = b""
    parts = text.split("/p2p/")
    for index, part in enumerate(parts):
        if index:
            peer, _, rest = part.partition("/")
            multihash = base58.b58decode(peer)
            out += bytes.fromhex("a503") + _varint(len(multihash)) + multihash
            part = "/" + rest if rest else ""
        if part:
            out += Multiaddr(part).to_bytes()
    return out


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def peer_of(maddr: str) -> str | None:
    """The last ``/p2p/ID`` of a multiaddr (the peer it reaches), if any."""
    _, _, peer = maddr.rpartition("/p2p/")
    return peer.split("/")[0] or None


def circuit_addrs(relays: Sequence[str], peer_id: str) -> list[str]:
    """Where others reach ``peer_id`` through each relay (relays as ``/ip4/.../p2p/RELAY``)."""
    return [f"{relay}/p2p-circuit/p2p/{peer_id}" for relay in relays if peer_of(relay)]


async def open_path(p2p: P2P, peer_id: str, addrs: Sequence[str]) -> None:
    """Connect to ``peer_id`` through ``addrs`` (its relay circuits); a no-op when already connected."""
    maddrs = [_RawMaddr(maddr_bytes(a)) for a in addrs]
    async with asyncio.timeout(DIAL_TIMEOUT):
        await p2p._client.connect(PeerID.from_base58(peer_id), maddrs)


async def open_paths(p2p: P2P, relayed: dict[str, list[str]]) -> None:
    """``open_path`` for every relayed peer; one that fails stays unreached (its calls fail and fail over)."""

    async def one(peer_id: str, addrs: list[str]) -> None:
        try:
            await open_path(p2p, peer_id, addrs)
        except Exception as exc:  # p2pd's errors are untyped; the caller's routing decides what an absence means
            logger.debug("no path to relayed node %s: %s", peer_id, exc)

    await asyncio.gather(*(one(peer, addrs) for peer, addrs in relayed.items() if addrs))


class DialBackService:
    """The helper's side: answers ``DialBack`` by dialling from a throw-away host, one check at a time."""

    def __init__(self, p2p: P2P) -> None:
        self._p2p = p2p
        self._lock = asyncio.Lock()  # each check starts a p2pd: never many at once

    async def register(self) -> None:
        await self._p2p.add_protobuf_handler(DIALBACK_HANDLER, self.handle, runtime_pb2.ExpertRequest)

    async def handle(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            message = DialBack.model_validate_json(request.metadata)
        except ValidationError:
            return _reply(DialBackResult(reached=[]))
        caller = context.remote_id.to_base58()
        allowed = await self._dialable(message.addrs, caller)
        async with self._lock:
            reached = await _dial_from_fresh_host(caller, allowed)
        logger.info("dial-back for %s: %d of %d addresses answered", caller, len(reached), len(message.addrs))
        return _reply(DialBackResult(reached=reached))

    async def _dialable(self, addrs: Sequence[str], caller: str) -> list[str]:
        me = self._p2p.peer_id.to_base58()
        observed = await self._observed_ips(caller)
        allowed = []
        for addr in addrs:
            if peer_of(addr) not in (None, caller):
                continue
            if "/p2p-circuit" in addr:
                if addr.split("/p2p-circuit")[0].endswith(f"/p2p/{me}"):
                    allowed.append(addr)
            elif _ip_of(addr) in observed:
                allowed.append(addr)
        return allowed

    async def _observed_ips(self, caller: str) -> set[str]:
        for info in await self._p2p.list_peers():
            if info.peer_id.to_base58() == caller:
                return {ip for ip in (_ip_of(str(a)) for a in info.addrs) if ip}
        return set()


async def _dial_from_fresh_host(peer_id: str, addrs: Sequence[str]) -> list[str]:
    if not addrs:
        return []
    # A host of its own: no listening, no bootstrap, no relay service, no port mapping — it only dials out.
    probe = await P2P.create(
        host_maddrs=[], no_listen=True, nat_port_map=False, auto_nat=False, use_relay=True, idle_timeout=30
    )
    reached = []
    try:
        for addr in addrs:
            try:
                await open_path(probe, peer_id, [addr])
                reached.append(addr)
            except Exception as exc:  # p2pd's dial errors are untyped strings; any of them means "not this way"
                logger.debug("dial-back of %s via %s failed: %s", peer_id, addr, exc)
    finally:
        with contextlib.suppress(Exception):
            await probe.shutdown()
    return reached


async def ask_dial_back(p2p: P2P, helper: str, addrs: Sequence[str]) -> list[str]:
    """Which of ``addrs`` the ``helper`` peer could dial (raises when the helper cannot be asked)."""
    request = runtime_pb2.ExpertRequest(
        metadata=DialBack(addrs=list(addrs)[:MAX_DIALBACK_ADDRS]).model_dump_json().encode()
    )
    async with asyncio.timeout(DIALBACK_ANSWER_TIMEOUT):
        response = await p2p.call_protobuf_handler(
            PeerID.from_base58(helper), DIALBACK_HANDLER, request, runtime_pb2.ExpertResponse
        )
    return DialBackResult.model_validate_json(response.metadata).reached


def _reply(result: DialBackResult) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=result.model_dump_json().encode())


def _ip_of(maddr: str) -> str | None:
    parts = maddr.split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts:
            value = parts[parts.index(proto) + 1]
            with contextlib.suppress(ValueError):
                return str(ipaddress.ip_address(value))
    return None


def describe(verdict: Reachability, relays: Sequence[str]) -> str:
    """The verdict in plain words, for the node's log."""
    if verdict is Reachability.DIRECT:
        return "reachable directly: other peers can dial this node"
    if verdict is Reachability.RELAYED:
        return f"not reachable directly (behind NAT or a firewall): reachable through relay {', '.join(relays)}"
    return (
        "NOT reachable: no peer could dial this node and no relay took it; the swarm will not route to it. Open a port"
        " and pass --announce-maddrs, or let it use a relay (--use-relay, and a bootstrap peer with --relay-hop)"
    )


__all__ = [
    "DIALBACK_HANDLER",
    "DialBackService",
    "Reachability",
    "ask_dial_back",
    "circuit_addrs",
    "describe",
    "maddr_bytes",
    "open_path",
    "open_paths",
]
