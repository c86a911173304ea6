"""Receipts: every step reply is signed by the node that computed it, so a wrong output names its node.

A receipt signs what one step of one session did on one node: (session id, position, blocks start:end, sha256 of
the input hidden states, sha256 of the output), under a domain prefix and the signer's peer id. The gateway rebuilds
that statement from what it sent and received and checks the signature against the key bound to the peer id it
routed to; a reply without a valid receipt is a ``BadReceipt`` (the session fails over, the node loses trust).

Which key signs. The peer key (RSA-2048, ``shared.identity``) is what a peer id names, but RSA signs slowly and a
node answers every decode step of every session. Each node process therefore draws an Ed25519 *step key* and
certifies it once with its peer key (``StepKeyCertificate``, sent when a session opens): the certificate carries
the RSA public key (whose multihash must be the peer id, libp2p's rule) and its signature over (peer id, step key).
Receipts are signed with the step key, one signature per reply message (a batch reply's rows are signed together:
the signed message is the hash of every row's statement digest, so one row's receipt carries its siblings'
digests). Measured on this project's 2-core AMD EPYC (``bench/receipts.py``): RSA-2048 signs in ~250 µs and
verifies in ~20 µs, Ed25519 ~32 µs and ~110 µs. Per reply, the step key costs a node ~30 µs instead of ~250 µs and
the gateway ~110 µs instead of ~20 µs, plus one RSA check per session opened: cheaper on the path of a token per
hop (~140 µs against ~270 µs), and nodes answer many gateways. The certificate names the peer id, and so does every
signed message: a node cannot present another's certificate (its RSA key would not hash to that peer id), nor
relabel another node's receipt as its own or its own as another's.

What a receipt proves: this node claims it computed this output from this input for this session step. Not that
the output is right — a node can sign garbage; receipts make blame attributable (a failed spot check names the node
by its signed statement, and no node can frame another), the checks in ``gateway.swarm.verify`` decide what is right.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic import BaseModel, ConfigDict, Field

from shared.errors import BadReceipt
from shared.identity import peer_id_of

RECEIPT_DOMAIN = b"swarmgate/receipt/v1\x00"  # what a step key signs: never valid as anything else
STEP_KEY_DOMAIN = b"swarmgate/step-key/v1\x00"  # what a peer key signs to certify a step key


class StepKeyCertificate(BaseModel):
    """A node's step key, certified by its peer key (sent in ``SessionOpened``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_key: str = Field(max_length=2048)  # the RSA public key, OpenSSH form (its multihash is the peer id)
    step_key: str = Field(min_length=64, max_length=64)  # the Ed25519 public key, raw, hex
    signature: str = Field(max_length=1024)  # base64 RSA signature of STEP_KEY_DOMAIN, peer id, step key


def tensor_digest(hidden: torch.Tensor) -> bytes:
    """sha256 of a hidden-states tensor as it travels: dtype, shape and element bytes (the same on both sides)."""
    tensor = hidden.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}".encode())
    digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.digest()


@dataclass(frozen=True)
class StepStatement:
    """What one step of one session did on a node: the thing a receipt signs."""

    session_id: str  # the node's name for the session (``SessionOpened.session_id``)
    position: int
    start: int
    end: int
    input_digest: bytes  # tensor_digest of the input [1, T, D]
    output_digest: bytes

    @classmethod
    def of(
        cls, session_id: str, position: int, blocks: tuple[int, int], inputs: torch.Tensor, output: torch.Tensor
    ) -> StepStatement:
        return cls(session_id, position, blocks[0], blocks[1], tensor_digest(inputs), tensor_digest(output))

    def digest(self) -> bytes:
        head = f"{self.session_id}\x00{self.position}\x00{self.start}\x00{self.end}\x00".encode()
        return hashlib.sha256(RECEIPT_DOMAIN + head + self.input_digest + self.output_digest).digest()


def _signed_message(peer_id: str, digests: Sequence[bytes]) -> bytes:
    return RECEIPT_DOMAIN + peer_id.encode() + b"\x00" + hashlib.sha256(b"".join(digests)).digest()


class StepKey:
    """A node process's step key and its certificate (``peer_key``: the node's libp2p identity key)."""

    def __init__(self, peer_key: RSAPrivateKey) -> None:
        self._key = Ed25519PrivateKey.generate()
        public_key = peer_key.get_public_key().to_bytes()
        self.peer_id = peer_id_of(public_key)
        step_key = self._key.public_key().public_bytes_raw()
        self.certificate = StepKeyCertificate(
            peer_key=public_key.decode(),
            step_key=step_key.hex(),
            signature=peer_key.sign(_certified(self.peer_id, step_key)).decode(),
        )

    def sign(self, statements: Sequence[StepStatement]) -> str:
        """The receipt of a reply's rows (base64 of one Ed25519 signature), as ``StepResult.receipt`` carries it."""
        message = _signed_message(self.peer_id, [s.digest() for s in statements])
        return base64.b64encode(self._key.sign(message)).decode()


def _certified(peer_id: str, step_key: bytes) -> bytes:
    return STEP_KEY_DOMAIN + peer_id.encode() + b"\x00" + step_key


def verified_step_key(certificate: StepKeyCertificate, peer_id: str) -> Ed25519PublicKey:
    """The step key that ``certificate`` binds to ``peer_id``; ``BadReceipt`` unless ``peer_id``'s own key signed it."""
    try:
        signer = peer_id_of(certificate.peer_key.encode())
        rsa_key = RSAPublicKey.from_bytes(certificate.peer_key.encode())
        step_key = bytes.fromhex(certificate.step_key)
    except (ValueError, UnsupportedAlgorithm):
        raise BadReceipt(f"node {peer_id} sent an unreadable step-key certificate") from None
    if signer != peer_id:
        raise BadReceipt(f"node {peer_id} sent the step-key certificate of {signer}")
    if not rsa_key.verify(_certified(peer_id, step_key), certificate.signature.encode()):
        raise BadReceipt(f"node {peer_id}'s step-key certificate is not signed by its peer key")
    return Ed25519PublicKey.from_public_bytes(step_key)


@dataclass(frozen=True)
class Receipt:
    """One step's signed statement as the gateway checked it: kept with spot checks and shown as evidence."""

    signer: str  # the peer id whose step key signed it
    statement: StepStatement
    signature: str  # base64 Ed25519 signature of the digests of every row signed together
    batch: tuple[bytes, ...]  # those digests, in order; this statement's is batch[index]
    index: int = 0

    def check(self, key: Ed25519PublicKey) -> None:
        """``BadReceipt`` unless ``key`` signed this statement under ``signer``."""
        if not 0 <= self.index < len(self.batch) or self.batch[self.index] != self.statement.digest():
            raise BadReceipt(f"the receipt of node {self.signer} does not cover its step")
        try:
            key.verify(base64.b64decode(self.signature, validate=True), _signed_message(self.signer, self.batch))
        except (InvalidSignature, ValueError):
            raise BadReceipt(f"node {self.signer}'s receipt does not verify") from None

    def evidence(self) -> dict[str, Any]:
        """The receipt as operators see it (``/v1/swarm``, logs): enough to check it again offline."""
        s = self.statement
        return {
            "signer": self.signer,
            "session": s.session_id,
            "position": s.position,
            "blocks": f"{s.start}:{s.end}",
            "input_sha256": s.input_digest.hex(),
            "output_sha256": s.output_digest.hex(),
            "signature": self.signature,
            "rows_signed": len(self.batch),
        }

    def describe(self) -> str:
        s = self.statement
        return (
            f"receipt of {self.signer}: session {s.session_id} position {s.position} blocks {s.start}:{s.end},"
            f" input sha256 {s.input_digest.hex()[:16]}…, output sha256 {s.output_digest.hex()[:16]}…"
        )


def check_receipts(
    key: Ed25519PublicKey, signer: str, statements: Sequence[StepStatement], signature: str
) -> list[Receipt]:
    """Each statement's receipt, once one ``signature`` over all of them verified under ``key``; ``BadReceipt``
    otherwise (a reply is signed whole: one bad row makes every row's output unattributable)."""
    batch = tuple(s.digest() for s in statements)
    receipts = [Receipt(signer, s, signature, batch, index) for index, s in enumerate(statements)]
    if receipts:
        receipts[0].check(key)
    return receipts


@dataclass(frozen=True)
class ReceiptCheck:
    """What the gateway holds one node session's receipts to: the step key its peer id certified at open."""

    signer: str  # the peer id routed to
    key: Ed25519PublicKey
    session_id: str
    blocks: tuple[int, int]

    def statement(self, position: int, inputs: torch.Tensor, output: torch.Tensor) -> StepStatement:
        return StepStatement.of(self.session_id, position, self.blocks, inputs, output)

    def receipt(self, position: int, inputs: torch.Tensor, output: torch.Tensor, signature: str) -> Receipt:
        """The receipt of a reply of one step; ``BadReceipt`` unless it verifies."""
        return check_receipts(self.key, self.signer, [self.statement(position, inputs, output)], signature)[0]
