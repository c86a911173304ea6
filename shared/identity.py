"""A peer's libp2p identity is the RSA key that signs its DHT records, so a record proves who announced it.

hivemind signs protected records with a process-wide RSA key that has nothing to do with the peer id libp2p
authenticates; the subkey merely *says* which peer id it belongs to. A swarm member (who holds the swarm secret)
could therefore announce a record for another peer id under its own key. Here one RSA key does both jobs: it is
written as the p2pd identity (so the peer id is the multihash of its public key, libp2p's rule for RSA keys) and
it signs the DHT records. A reader derives the peer id from the owner key in a record's subkey and drops the
record unless that is the peer id the subkey names (``membership.PeerBindingValidator``) — no RPC, no trust.

    identity file (libp2p protobuf, RSA) ──p2pd──▶ peer id = base58(multihash(sha256(protobuf(public key))))
                  └── same key ──RSASignatureValidator──▶ subkey  b"<peer id>[owner:ssh-rsa …]"  + signature
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

_SHA256_MULTIHASH = b"\x12\x20"  # multihash code of sha2-256, then the digest length (32)


class _LoadedRSAKey(RSAPrivateKey):
    """hivemind's key type around an existing key (its constructor always generates a new one)."""

    def __init__(self, key: rsa.RSAPrivateKey) -> None:
        self._private_key = key


@dataclass(frozen=True)
class PeerIdentity:
    key: RSAPrivateKey
    peer_id: str  # base58, as libp2p derives it from the key
    path: str | None = None  # the identity file it was read from; None: generated for this DHT only

    @property
    def owner_marker(self) -> bytes:
        """The ``[owner:ssh-rsa …]`` marker its records' subkeys carry."""
        return RSASignatureValidator(self.key).local_public_key

    @contextlib.contextmanager
    def key_file(self) -> Iterator[str]:
        """A path p2pd can read the key from: the identity file, or a private temporary one removed afterwards."""
        if self.path is not None:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix="swarmgate-identity-") as folder:  # mode 0700
            path = os.path.join(folder, "identity.key")
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(descriptor, "wb") as file:
                file.write(_protobuf(self.key))
            yield path


def new_identity() -> PeerIdentity:
    key = RSAPrivateKey()
    return PeerIdentity(key, peer_id_of(key.get_public_key().to_bytes()))


def load_identity(path: str) -> PeerIdentity:
    """The identity in ``path`` (created as hivemind does when missing); it must be an RSA key."""
    if not Path(path).exists():
        P2P.generate_identity(path)  # an RSA key, mode 0400
    stored = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
    if stored.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError(f"{path}: the identity key must be RSA (as `swarmgate-identity` writes it)")
    key = serialization.load_der_private_key(stored.data, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{path}: the identity key must be RSA (as `swarmgate-identity` writes it)")
    loaded = _LoadedRSAKey(key)
    return PeerIdentity(loaded, peer_id_of(loaded.get_public_key().to_bytes()), path)


@functools.lru_cache(maxsize=4096)
def peer_id_of(ssh_public_key: bytes) -> str:
    """The libp2p peer id of an RSA public key given in OpenSSH form (how owner markers carry it)."""
    key = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    return str(base58.b58encode(_SHA256_MULTIHASH + hashlib.sha256(encoded).digest()).decode())


def _protobuf(key: RSAPrivateKey) -> bytes:
    return bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString())


# Identities of the DHTs this process started, by peer id: announcing needs the owner marker of the right key.
_registered: dict[str, PeerIdentity] = {}


def register_identity(identity: PeerIdentity) -> None:
    _registered[identity.peer_id] = identity


def registered_identity(peer_id: str) -> PeerIdentity:
    try:
        return _registered[peer_id]
    except KeyError:
        raise ValueError(f"no DHT started by this process has the peer id {peer_id}") from None
