"""Who may take part in a private swarm, and who may change which DHT record.

hivemind's daemon has no pre-shared key, so membership is enforced at two layers of our own:

* **DHT records.** Every record is stored under a subkey carrying its owner's RSA public key and is signed with it
  (hivemind's ``RSASignatureValidator``): DHT peers refuse to store, and readers refuse to accept, a change to a
  record signed by anyone else. Every value must also parse as one of our record schemas, strictly. In a private
  swarm each record additionally carries an HMAC of the whole signed record under the swarm secret
  (``MembershipValidator``): records from peers without the secret are refused on store and dropped on read, and a
  member's record copied under another subkey fails its MAC.
* **Peer ids.** A member holds the secret, so the MAC cannot stop it from announcing a record for *another* peer id
  under its own owner key. The owner key is therefore the peer's libp2p identity key (``shared.identity``): a
  record's subkey must name exactly the peer id derived from the owner key it carries (``PeerBindingValidator``),
  so only the holder of a peer's private key can announce for that peer id.
* **RPCs.** Callers put a call token in every session/forward/info request: an HMAC under the swarm secret of the
  caller's and the callee's peer ids (the caller's id is authenticated by libp2p), a timestamp and a nonce. Nodes
  refuse requests without a valid token, and a token seen before is refused (``ReplayGuard``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgpack
from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import BaseModel, ValidationError

from shared.errors import Unauthorized
from shared.identity import peer_id_of, registered_identity

TOKEN_LIFETIME = 300.0  # seconds a call token is accepted after it was made (clocks may differ a little)
_MAC_FORMAT = b"[member:_mac_]"
_MAC_RE = re.compile(re.escape(_MAC_FORMAT).replace(b"_mac_", rb"([0-9a-f]{64})"))
_BOUND_SUBKEY_RE = re.compile(rb"([1-9A-HJ-NP-Za-km-z]+)\[owner:(.+)\]", re.DOTALL)  # base58 peer id, owner key


def load_secret(value: str | None, path: str | None) -> bytes | None:
    """The swarm secret from a value or a file (a Kubernetes Secret mounted as a file); None: a public swarm."""
    if path:
        secret = Path(path).expanduser().read_bytes().strip()
    elif value:
        secret = value.encode()
    else:
        return None
    if len(secret) < 16:
        raise ValueError("the swarm secret must be at least 16 bytes long")
    return secret


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"\x00".join(parts), hashlib.sha256).hexdigest()


class MembershipValidator(RecordValidatorBase):
    """Records must carry an HMAC of (key, subkey, value, expiration) under the swarm secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _record_mac(self, record: DHTRecord, value: bytes) -> str:
        return _mac(self._secret, record.key, record.subkey, value, repr(record.expiration_time).encode())

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + _MAC_FORMAT.replace(b"_mac_", self._record_mac(record, record.value).encode())

    def strip_value(self, record: DHTRecord) -> bytes:
        return _MAC_RE.sub(b"", record.value)

    def validate(self, record: DHTRecord) -> bool:
        macs = _MAC_RE.findall(record.value)
        if len(macs) != 1:
            return False
        expected = self._record_mac(record, self.strip_value(record))
        return hmac.compare_digest(macs[0].decode(), expected)

    @property
    def priority(self) -> int:
        return 5  # signs before the owner's RSA signature covers it; validated after that signature is checked

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, MembershipValidator) and other._secret == self._secret


class SchemaValidator(RecordValidatorBase):
    """Every value must be one of our record models, with no unknown fields."""

    def __init__(self, models: tuple[type[BaseModel], ...]) -> None:
        self._models = models

    def validate(self, record: DHTRecord) -> bool:
        try:
            value: Any = msgpack.unpackb(record.value, raw=False, strict_map_key=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return False
        for model in self._models:
            try:
                model.model_validate(value, strict=False)
            except ValidationError:
                continue
            return True
        return False

    @property
    def priority(self) -> int:
        return 0  # runs last, on the value stripped of every signature

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SchemaValidator)


class PeerBindingValidator(RecordValidatorBase):
    """A record's subkey must be ``<peer id>[owner:<key>]`` where the peer id is the one derived from the key."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # msgpack raises a zoo of types on garbage
            return False
        match = _BOUND_SUBKEY_RE.fullmatch(subkey) if isinstance(subkey, bytes) else None
        if match is None:
            return False
        try:
            return peer_id_of(match[2]) == match[1].decode()
        except (ValueError, UnsupportedAlgorithm):
            return False

    @property
    def priority(self) -> int:
        return 20  # validated first: a cheap check (its peer-id derivation is cached) before the RSA signature

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PeerBindingValidator)


def record_validators(
    secret: bytes | None, models: tuple[type[BaseModel], ...], key: RSAPrivateKey | None = None
) -> list[RecordValidatorBase]:
    """``key``: the DHT's identity key, which signs its records (None: hivemind's process-wide key, for readers)."""
    validators: list[RecordValidatorBase] = [
        RSASignatureValidator(key),
        PeerBindingValidator(),
        SchemaValidator(models),
    ]
    if secret is not None:
        validators.append(MembershipValidator(secret))
    return validators


def owner_subkey(peer_id: str) -> bytes:
    """The subkey a DHT started here stores its records under: its peer id, then its identity's owner marker."""
    return peer_id.encode() + registered_identity(peer_id).owner_marker


def peer_of_subkey(subkey: object) -> str:
    raw = subkey if isinstance(subkey, bytes) else str(subkey).encode()
    return raw.split(b"[owner:", 1)[0].decode(errors="replace")


def make_call_token(secret: bytes, caller: str, callee: str, now: float | None = None) -> str:
    issued = str(int((now if now is not None else time.time()) * 1000))  # milliseconds: no dot in the token
    nonce = secrets.token_hex(12)
    return f"{issued}.{nonce}.{_mac(secret, caller.encode(), callee.encode(), issued.encode(), nonce.encode())}"


class ReplayGuard:
    """Accepts each valid call token once, within its lifetime."""

    def __init__(self, secret: bytes, lifetime: float = TOKEN_LIFETIME, capacity: int = 100_000) -> None:
        self._secret = secret
        self._lifetime = lifetime
        self._capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check(self, token: str | None, caller: str, callee: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not token:
            raise Unauthorized("this swarm is private: the request carries no call token")
        try:
            issued_text, nonce, mac = token.split(".")
            issued = int(issued_text) / 1000
        except ValueError:
            raise Unauthorized("malformed call token") from None
        expected = _mac(self._secret, caller.encode(), callee.encode(), issued_text.encode(), nonce.encode())
        if not hmac.compare_digest(mac, expected):
            raise Unauthorized("invalid call token (wrong swarm secret, or made for another peer)")
        if abs(now - issued) > self._lifetime:
            raise Unauthorized("expired call token")
        self._forget_before(now - self._lifetime)
        if nonce in self._seen:
            raise Unauthorized("replayed call token")
        self._seen[nonce] = issued
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)

    def _forget_before(self, cutoff: float) -> None:
        while self._seen and next(iter(self._seen.values())) < cutoff:
            self._seen.popitem(last=False)


class CallAuth:
    """Makes the call tokens this process attaches to its requests (none in a public swarm)."""

    def __init__(self, secret: bytes | None, own_peer_id: str) -> None:
        self._secret = secret
        self._own_peer_id = own_peer_id

    def token_for(self, callee: str) -> str | None:
        return make_call_token(self._secret, self._own_peer_id, callee) if self._secret else None
