"""The circuit relay v2 hop messages we send and read, byte for byte as libp2p's spec lays them out."""

from __future__ import annotations

import time

from shared.relay_reservation import STATUS_OK, STATUS_TYPE, HopMessage, Reservation, _until_renewal


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def test_a_reserve_request_is_the_spec_s_two_bytes() -> None:
    # HopMessage{type: RESERVE}: field 1 (varint) = 0, which proto2's `required` puts on the wire.
    assert HopMessage(type=0).SerializeToString() == b"\x08\x00"


def test_a_relay_s_ok_answer_is_read_with_its_expiry_and_the_rest_skipped() -> None:
    expire = 1_800_000_000
    reservation = b"\x08" + _varint(expire) + b"\x12\x02\xaa\xbb" + b"\x1a\x03voc"  # expire, one addr, a voucher
    limit = b"\x08" + _varint(120) + b"\x10" + _varint(1 << 17)  # duration, data: fields we do not declare
    wire = b"\x08\x02" + b"\x1a" + _varint(len(reservation)) + reservation + b"\x22" + _varint(len(limit)) + limit
    wire += b"\x28" + _varint(100)  # status: OK
    reply = HopMessage.FromString(wire)
    assert (reply.type, reply.status) == (STATUS_TYPE, STATUS_OK)
    assert reply.HasField("reservation") and reply.reservation.expire == expire
    assert list(reply.reservation.addrs) == [b"\xaa\xbb"]


def test_a_refusal_carries_its_status() -> None:
    reply = HopMessage.FromString(b"\x08\x02\x28" + _varint(200))  # RESERVATION_REFUSED
    assert reply.status == 200 and not reply.HasField("reservation")


def test_renewal_comes_at_half_the_time_left_and_soon_after_a_failure() -> None:
    held = Reservation("/ip4/10.0.0.1/tcp/1/p2p/QmRelay", time.time() + 3600)
    assert 1700 < _until_renewal(held) <= 1800
    assert _until_renewal(Reservation("/ip4/10.0.0.1/tcp/1/p2p/QmRelay", time.time() - 5)) >= 5
    assert _until_renewal(None) > 0
