"""Receipts (shared.receipts): a node's signed statement of each step verifies under the step key its peer id
certified, and under nothing else; any change to what it states breaks it; no node can sign as another."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

from shared.errors import BadReceipt
from shared.identity import PeerIdentity, new_identity
from shared.receipts import (
    Receipt,
    StepKey,
    StepKeyCertificate,
    StepStatement,
    check_receipts,
    tensor_digest,
    verified_step_key,
)


@pytest.fixture(scope="module")
def node_a() -> tuple[PeerIdentity, StepKey]:
    identity = new_identity()
    return identity, StepKey(identity.key)


@pytest.fixture(scope="module")
def node_b() -> tuple[PeerIdentity, StepKey]:
    identity = new_identity()
    return identity, StepKey(identity.key)


def statement(session: str = "s1", position: int = 7, seed: int = 0) -> StepStatement:
    generator = torch.Generator().manual_seed(seed)
    inputs, output = torch.randn(1, 1, 16, generator=generator), torch.randn(1, 1, 16, generator=generator)
    return StepStatement.of(session, position, (0, 4), inputs, output)


def signed(node: tuple[PeerIdentity, StepKey], statements: list[StepStatement]) -> list[Receipt]:
    identity, key = node
    public = verified_step_key(key.certificate, identity.peer_id)
    return check_receipts(public, identity.peer_id, statements, key.sign(statements))


def test_a_receipt_round_trips_and_shows_what_it_signs(node_a: tuple[PeerIdentity, StepKey]) -> None:
    identity, key = node_a
    step = statement()
    (receipt,) = signed(node_a, [step])
    receipt.check(verified_step_key(key.certificate, identity.peer_id))
    evidence = receipt.evidence()
    assert evidence["signer"] == identity.peer_id == key.peer_id
    assert (evidence["session"], evidence["position"], evidence["blocks"]) == ("s1", 7, "0:4")
    assert evidence["output_sha256"] == step.output_digest.hex() and evidence["rows_signed"] == 1
    assert StepKeyCertificate.model_validate_json(key.certificate.model_dump_json()) == key.certificate


FIELDS = {
    "session_id": "s2",
    "position": 8,
    "start": 1,
    "end": 5,
    "input_digest": bytes(32),
    "output_digest": bytes(32),
}


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_changing_any_signed_field_breaks_the_receipt(node_a: tuple[PeerIdentity, StepKey], field: str) -> None:
    identity, key = node_a
    step = statement()
    signature = key.sign([step])
    public = verified_step_key(key.certificate, identity.peer_id)
    check_receipts(public, identity.peer_id, [step], signature)
    with pytest.raises(BadReceipt):
        check_receipts(public, identity.peer_id, [dataclasses.replace(step, **{field: FIELDS[field]})], signature)


def test_a_changed_or_garbage_signature_is_refused(node_a: tuple[PeerIdentity, StepKey]) -> None:
    identity, key = node_a
    public = verified_step_key(key.certificate, identity.peer_id)
    step = statement()
    signature = bytearray(key.sign([step]).encode())
    signature[5] = ord("A") if signature[5] != ord("A") else ord("B")
    for bad in (signature.decode(), "", "not base64!"):
        with pytest.raises(BadReceipt):
            check_receipts(public, identity.peer_id, [step], bad)


def test_a_receipt_of_node_b_relabelled_as_node_a_fails(
    node_a: tuple[PeerIdentity, StepKey], node_b: tuple[PeerIdentity, StepKey]
) -> None:
    (a, a_key), (b, b_key) = node_a, node_b
    step = statement()
    (receipt,) = signed(node_b, [step])
    relabelled = dataclasses.replace(receipt, signer=a.peer_id)
    with pytest.raises(BadReceipt):  # held to A's key, as the gateway holds what it routed to A
        relabelled.check(verified_step_key(a_key.certificate, a.peer_id))
    with pytest.raises(BadReceipt):  # and B's own key signed it as B's: not as A's either
        relabelled.check(verified_step_key(b_key.certificate, b.peer_id))


def test_no_node_can_present_another_nodes_step_key_as_its_own(
    node_a: tuple[PeerIdentity, StepKey], node_b: tuple[PeerIdentity, StepKey]
) -> None:
    (a, a_key), (b, b_key) = node_a, node_b
    with pytest.raises(BadReceipt, match="certificate of"):  # B's certificate where A was routed to
        verified_step_key(b_key.certificate, a.peer_id)
    # A's peer key with B's step key: the signature was A's over A's own step key
    forged = a_key.certificate.model_copy(update={"step_key": b_key.certificate.step_key})
    with pytest.raises(BadReceipt, match="not signed"):
        verified_step_key(forged, a.peer_id)
    # B certifying A's step key under B's peer id: A's receipts still say A, so they do not pass as B's
    claimed = StepKeyCertificate(
        peer_key=b_key.certificate.peer_key,
        step_key=a_key.certificate.step_key,
        signature=b.key.sign(
            b"swarmgate/step-key/v1\x00" + b.peer_id.encode() + b"\x00" + bytes.fromhex(a_key.certificate.step_key)
        ).decode(),
    )
    as_b = verified_step_key(claimed, b.peer_id)
    (receipt,) = signed(node_a, [statement()])
    with pytest.raises(BadReceipt):
        dataclasses.replace(receipt, signer=b.peer_id).check(as_b)
    with pytest.raises(BadReceipt):
        verified_step_key(a_key.certificate.model_copy(update={"peer_key": "ssh-rsa AAAA"}), a.peer_id)


def test_a_batch_is_signed_whole_and_each_row_carries_its_siblings(node_a: tuple[PeerIdentity, StepKey]) -> None:
    identity, key = node_a
    public = verified_step_key(key.certificate, identity.peer_id)
    rows = [statement(f"s{i}", 3, seed=i) for i in range(3)]
    signature = key.sign(rows)
    receipts = check_receipts(public, identity.peer_id, rows, signature)
    for index, receipt in enumerate(receipts):  # each stands alone as evidence
        assert receipt.index == index and receipt.evidence()["rows_signed"] == 3
        receipt.check(public)
    for changed in (rows[:2], rows[::-1]):  # a row dropped or the rows reordered
        with pytest.raises(BadReceipt):
            check_receipts(public, identity.peer_id, changed, signature)
    with pytest.raises(BadReceipt):  # a row's statement swapped for a sibling's
        dataclasses.replace(receipts[0], statement=rows[1]).check(public)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_tensor_digests_the_same_after_the_wire(dtype: torch.dtype) -> None:
    hidden = torch.randn(3, 1, 16).to(dtype)
    travelled = deserialize_torch_tensor(serialize_torch_tensor(hidden))  # bfloat16 travels widened to float32
    assert tensor_digest(travelled) == tensor_digest(hidden) == tensor_digest(hidden[:, :, :].clone())
    assert tensor_digest(hidden[1:2]) == tensor_digest(travelled[1:2])  # a batch row, as both sides slice it
    assert tensor_digest(hidden.float()) != tensor_digest(hidden) or dtype is torch.float32
    assert tensor_digest(hidden.reshape(1, 3, 16)) != tensor_digest(hidden)  # the shape is part of it
