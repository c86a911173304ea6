"""Call tokens, replay protection and the DHT record validators of a private swarm."""

from __future__ import annotations

import dataclasses
import os

import msgpack
import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.utils import MSGPackSerializer

from shared.dht_records import ModelRecord, NodeState, ServerRecord
from shared.errors import Unauthorized
from shared.identity import load_identity, new_identity, peer_id_of, register_identity
from shared.membership import (
    MembershipValidator,
    PeerBindingValidator,
    ReplayGuard,
    SchemaValidator,
    load_secret,
    make_call_token,
    owner_subkey,
    peer_of_subkey,
    record_validators,
)

SECRET = b"correct horse battery staple"


def test_a_token_is_accepted_once_for_its_caller_and_callee_within_its_lifetime() -> None:
    guard = ReplayGuard(SECRET, lifetime=60)
    token = make_call_token(SECRET, "caller", "node", now=1000.0)
    guard.check(token, "caller", "node", now=1010.0)
    with pytest.raises(Unauthorized, match="replayed"):
        guard.check(token, "caller", "node", now=1011.0)
    with pytest.raises(Unauthorized, match="invalid"):
        guard.check(make_call_token(SECRET, "caller", "node", now=1000.0), "someone else", "node", now=1010.0)
    with pytest.raises(Unauthorized, match="invalid"):
        guard.check(make_call_token(SECRET, "caller", "other node", now=1000.0), "caller", "node", now=1010.0)
    with pytest.raises(Unauthorized, match="invalid"):
        guard.check(make_call_token(b"wrong secret, long enough", "caller", "node", now=1000.0), "caller", "node")
    with pytest.raises(Unauthorized, match="expired"):
        guard.check(make_call_token(SECRET, "caller", "node", now=1000.0), "caller", "node", now=1100.0)
    with pytest.raises(Unauthorized, match="no call token"):
        guard.check(None, "caller", "node")
    with pytest.raises(Unauthorized, match="malformed"):
        guard.check("garbage", "caller", "node")


def test_secrets_are_read_from_a_value_or_a_file_and_must_be_long(tmp_path: pytest.TempPathFactory) -> None:
    assert load_secret(None, None) is None
    assert load_secret("x" * 16, None) == b"x" * 16
    path = tmp_path / "secret"  # type: ignore[operator]
    path.write_text("y" * 20 + "\n")
    assert load_secret("ignored value, file wins", str(path)) == b"y" * 20
    with pytest.raises(ValueError):
        load_secret("short", None)


def _record(value: object, subkey: bytes = b"peer") -> DHTRecord:
    return DHTRecord(key=b"key", subkey=subkey, value=msgpack.packb(value), expiration_time=123.0)


SERVER = ServerRecord(peer_id="peer", start=0, end=3, state=NodeState.ONLINE, version="x", protocol=1).model_dump(
    mode="json"
)


def test_schema_validator_accepts_only_our_records_without_unknown_fields() -> None:
    schema = SchemaValidator((ServerRecord, ModelRecord))
    assert schema.validate(_record(SERVER))
    assert schema.validate(_record({"name": "m", "num_blocks": 3, "family": "llama", "dtype": "float32"}))
    assert not schema.validate(_record({**SERVER, "surprise": 1}))
    assert not schema.validate(_record({**SERVER, "start": -1}))
    assert not schema.validate(_record("a string"))
    assert not schema.validate(DHTRecord(b"key", b"peer", b"\xc1 not msgpack", 1.0))


def test_membership_mac_binds_the_whole_record_to_the_secret() -> None:
    member = MembershipValidator(SECRET)
    record = _record(SERVER)
    signed = dataclasses.replace(record, value=member.sign_value(record))
    assert member.validate(signed)
    assert member.strip_value(signed) == record.value
    assert not MembershipValidator(b"another secret of a swarm").validate(signed)
    assert not member.validate(record)  # no MAC at all
    assert not member.validate(dataclasses.replace(signed, subkey=b"someone else"))  # copied under another subkey
    assert not member.validate(dataclasses.replace(signed, expiration_time=999.0))  # lifetime extended
    tampered = dataclasses.replace(signed, value=signed.value.replace(b"online", b"offline"))
    assert not member.validate(tampered)


def test_the_full_validator_chain_protects_owners_and_members() -> None:
    identity = new_identity()
    register_identity(identity)  # as start_dht does for the DHTs it starts
    chain = CompositeValidator(record_validators(SECRET, (ServerRecord, ModelRecord), identity.key))
    subkey = owner_subkey(identity.peer_id)
    assert peer_of_subkey(subkey) == identity.peer_id
    record = _record({**SERVER, "peer_id": identity.peer_id}, subkey=MSGPackSerializer.dumps(subkey))
    signed = dataclasses.replace(record, value=chain.sign_value(record))
    assert chain.validate(signed)
    assert chain.strip_value(signed) == record.value
    # Someone else (a fresh RSA key) cannot write under this owner's subkey: they cannot sign for it.
    unsigned = dataclasses.replace(record, value=MembershipValidator(SECRET).sign_value(record))
    assert not chain.validate(unsigned)
    # A peer without the secret is refused even under its own subkey.
    outsider = CompositeValidator(record_validators(None, (ServerRecord, ModelRecord), identity.key))
    assert not chain.validate(dataclasses.replace(record, value=outsider.sign_value(record)))


def test_identity_files_and_peer_ids_follow_libp2p(tmp_path: pytest.TempPathFactory) -> None:
    """The peer id we derive from an owner key is the one libp2p derives from the identity file (p2pd's own rule
    is checked for real by start_dht in the integration tests)."""
    path = str(tmp_path / "identity.key")  # type: ignore[operator]
    created = load_identity(path)  # missing: created as hivemind does
    with open(path, "rb") as file:
        assert created.peer_id == PeerID.from_identity(file.read()).to_base58()
    assert load_identity(path).peer_id == created.peer_id  # kept
    assert peer_id_of(created.key.get_public_key().to_bytes()) == created.peer_id
    fresh = new_identity()
    with fresh.key_file() as temporary, open(temporary, "rb") as file:
        assert PeerID.from_identity(file.read()).to_base58() == fresh.peer_id
    assert not os.path.exists(temporary)  # the temporary key file is gone


def test_a_member_cannot_announce_for_another_peer_id() -> None:
    """The swarm secret is not enough: the subkey's peer id must be the owner key's own."""
    member, victim = new_identity(), new_identity()
    binding = PeerBindingValidator()

    def subkey(peer_id: str, marker: bytes) -> bytes:
        return bytes(MSGPackSerializer.dumps(peer_id.encode() + marker))

    forged_value = {**SERVER, "peer_id": victim.peer_id}
    assert binding.validate(_record(SERVER, subkey(member.peer_id, member.owner_marker)))
    assert not binding.validate(_record(forged_value, subkey(victim.peer_id, member.owner_marker)))
    assert not binding.validate(_record(forged_value, subkey(victim.peer_id, b"")))  # no owner at all
    assert not binding.validate(_record(SERVER, subkey(member.peer_id, b"[owner:ssh-rsa garbage]")))
    assert not binding.validate(_record(SERVER, bytes(MSGPackSerializer.dumps("a string subkey"))))
    assert not binding.validate(_record(SERVER, b"\xc1 not msgpack"))
    # With every validator and the secret, the member's forgery still fails (its own record passes).
    register_identity(member)
    chain = CompositeValidator(record_validators(SECRET, (ServerRecord, ModelRecord), member.key))
    for peer_id, value in ((member.peer_id, SERVER), (victim.peer_id, forged_value)):
        record = _record(value, subkey(peer_id, member.owner_marker))
        signed = dataclasses.replace(record, value=chain.sign_value(record))
        assert chain.validate(signed) is (peer_id == member.peer_id)
