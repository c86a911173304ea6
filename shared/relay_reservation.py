"""Reserving a circuit relay v2 slot ourselves, at once, instead of waiting for p2pd's autorelay to get to it.

A node behind NAT is reachable at ``RELAY/p2p-circuit/p2p/NODE`` once the relay holds a reservation for it. p2pd
makes one only through go-libp2p's autorelay, which waits minutes before reserving when it knows fewer relays than
it wants (a node was usable 196 s after start), and its control protocol has no "reserve" request. But it opens a
stream to any peer on any protocol, and a reservation is one message on the relay's hop protocol (libp2p's
circuit-v2 spec): ``HopMessage{type: RESERVE}`` out, ``HopMessage{type: STATUS, status: OK, reservation}`` back, each
varint-length-prefixed. The relay ties the slot to our peer id while we stay connected and until ``expire``;
``RelaySlot`` renews it before then. p2pd's circuit transport accepts the relayed connections that arrive
through it (its STOP handler needs no autorelay), and autorelay stays on as the fallback.

The messages are built from the spec's schema with protobuf's descriptor API (no generated module to vendor); only
the fields we read are declared, all optional, so a relay's other fields are skipped as unknown ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import read_pbmsg_safe, write_pbmsg

from shared.background import Periodic
from shared.reachability import open_path, peer_of

logger = logging.getLogger(__name__)

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
RESERVE_TIMEOUT = 10.0  # seconds for one reservation: a dial (if not connected yet) and one round trip
RENEW_BEFORE = 0.5  # renew once half of the reservation's lifetime is left
RETRY_SECONDS = 5.0  # after a refused or failed reservation
MIN_RENEW_SECONDS = 5.0

_SCHEMA = """
name: "swarmgate/circuit_v2.proto" package: "swarmgate.circuit" syntax: "proto2"
message_type {
  name: "HopMessage"
  field { name: "type" number: 1 label: LABEL_OPTIONAL type: TYPE_ENUM type_name: ".swarmgate.circuit.HopType" }
  field { name: "reservation" number: 3 label: LABEL_OPTIONAL type: TYPE_MESSAGE
          type_name: ".swarmgate.circuit.Reservation" }
  field { name: "status" number: 5 label: LABEL_OPTIONAL type: TYPE_ENUM type_name: ".swarmgate.circuit.Status" }
}
message_type {
  name: "Reservation"
  field { name: "expire" number: 1 label: LABEL_OPTIONAL type: TYPE_UINT64 }
  field { name: "addrs" number: 2 label: LABEL_REPEATED type: TYPE_BYTES }
}
enum_type { name: "HopType" value { name: "RESERVE" number: 0 } value { name: "CONNECT" number: 1 }
            value { name: "STATUS" number: 2 } }
enum_type { name: "Status" value { name: "UNUSED" number: 0 } value { name: "OK" number: 100 }
            value { name: "RESERVATION_REFUSED" number: 200 } value { name: "RESOURCE_LIMIT_EXCEEDED" number: 201 }
            value { name: "PERMISSION_DENIED" number: 202 } value { name: "CONNECTION_FAILED" number: 203 }
            value { name: "NO_RESERVATION" number: 204 } value { name: "MALFORMED_MESSAGE" number: 400 }
            value { name: "UNEXPECTED_MESSAGE" number: 401 } }
"""


def _hop_message_class() -> Any:
    pool = descriptor_pool.DescriptorPool()  # our own pool: nothing else registers these names
    pool.Add(text_format.Parse(_SCHEMA, descriptor_pb2.FileDescriptorProto()))
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("swarmgate.circuit.HopMessage"))


HopMessage = _hop_message_class()
STATUS_OK = 100
STATUS_TYPE = 2


class ReservationRefused(Exception):
    """The relay answered, but with no slot (a status other than OK, or no reservation)."""


@dataclass(frozen=True)
class Reservation:
    relay: str  # the relay's multiaddr, /p2p/ID included
    expire: float  # unix time

    @property
    def circuit(self) -> str:
        return f"{self.relay}/p2p-circuit"


async def reserve(p2p: P2P, relay: str) -> Reservation:
    """Reserve a slot on ``relay`` (a multiaddr ending in /p2p/ID); raises ReservationRefused or a transport error."""
    relay_peer = peer_of(relay)
    if relay_peer is None:
        raise ValueError(f"no /p2p/ peer id in relay address {relay}")
    async with asyncio.timeout(RESERVE_TIMEOUT):
        with contextlib.suppress(Exception):  # already connected, or reachable from the peerstore: the stream says
            await open_path(p2p, relay_peer, [relay])
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(relay_peer), HOP_PROTOCOL)
        try:
            await write_pbmsg(writer, HopMessage(type=0))  # RESERVE
            reply = HopMessage()
            await read_pbmsg_safe(reader, reply)
        finally:
            writer.close()
    if reply.type != STATUS_TYPE or reply.status != STATUS_OK or not reply.HasField("reservation"):
        raise ReservationRefused(f"relay {relay_peer} answered type {reply.type}, status {reply.status}")
    return Reservation(relay, float(reply.reservation.expire))


async def reserve_any(p2p: P2P, relays: Sequence[str]) -> list[Reservation]:
    """A reservation on every relay that grants one, asked all at once; the others are logged and skipped."""

    async def one(relay: str) -> Reservation | None:
        try:
            return await reserve(p2p, relay)
        except Exception as exc:  # p2pd's stream errors are untyped; a refusal is as final here as a failed dial
            logger.info("relay %s gave no slot: %r", relay, exc)
            return None

    return [r for r in await asyncio.gather(*(one(relay) for relay in relays)) if r is not None]


class RelaySlot:
    """One relay slot held for the node's life: renewed at half its remaining lifetime, retried soon after a failure
    (the relay restarted, or our connection to it dropped). ``keeper()`` is the background job that does it."""

    def __init__(self, p2p: P2P, held: Reservation) -> None:
        self._p2p = p2p
        self.relay = held.relay
        self.held: Reservation | None = held

    def keeper(self) -> Periodic:
        failure = f"renewing the relay slot on {self.relay} failed"
        return Periodic(f"relay slot {self.relay}", self._until_renewal, self._renew, failure)

    def _until_renewal(self) -> float:
        return _until_renewal(self.held)

    async def _renew(self) -> None:
        self.held = None  # until the relay grants it again
        self.held = await reserve(self._p2p, self.relay)


def _until_renewal(held: Reservation | None) -> float:
    if held is None:
        return RETRY_SECONDS
    return max(MIN_RENEW_SECONDS, (held.expire - time.time()) * RENEW_BEFORE)
