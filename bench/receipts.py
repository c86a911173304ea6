"""What a step receipt (``shared.receipts``) costs per reply: the node hashes each row's input and output and signs
once; the gateway hashes the same and verifies once. Compared with signing each reply with the RSA-2048 peer key
itself, the alternative the step key replaces.

    python -m bench.receipts            # a few seconds; prints one line per (hidden size, rows)
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.identity import new_identity
from shared.receipts import Receipt, StepKey, StepStatement, check_receipts, verified_step_key


def per_call(work: Callable[[], object], seconds: float) -> float:
    """Microseconds per call of ``work``, the best of three runs of about ``seconds`` each."""
    best = float("inf")
    for _ in range(3):
        calls, began = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - began) < seconds:
            work()
            calls += 1
        best = min(best, elapsed / calls * 1e6)
    return best


def statements(inputs: torch.Tensor, outputs: torch.Tensor) -> list[StepStatement]:
    """One statement per row of a batch reply (inputs, outputs: [B, 1, D]), as both sides build them."""
    return [StepStatement.of(f"s{b}", 100, (0, 8), inputs[b : b + 1], outputs[b : b + 1]) for b in range(len(inputs))]


def node_side(key: StepKey, inputs: torch.Tensor, outputs: torch.Tensor) -> str:
    return key.sign(statements(inputs, outputs))


def gateway_side(
    public: Ed25519PublicKey, signer: str, inputs: torch.Tensor, outputs: torch.Tensor, signature: str
) -> list[Receipt]:
    return check_receipts(public, signer, statements(inputs, outputs), signature)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=0.3, help="length of each timed run")
    args = parser.parse_args()
    identity = new_identity()
    key = StepKey(identity.key)
    public = verified_step_key(key.certificate, identity.peer_id)
    rsa_key = rsa.generate_private_key(65537, 2048)  # as a peer key is
    rsa_public = rsa_key.public_key()
    message = b"x" * 96
    rsa_signature = rsa_key.sign(message, padding.PKCS1v15(), hashes.SHA256())
    pkcs, sha = padding.PKCS1v15(), hashes.SHA256()
    rsa_sign = per_call(lambda: rsa_key.sign(message, pkcs, sha), args.seconds)
    rsa_verify = per_call(lambda: rsa_public.verify(rsa_signature, message, pkcs, sha), args.seconds)
    certificate = per_call(lambda: verified_step_key(key.certificate, identity.peer_id), args.seconds)
    print(f"torch threads {torch.get_num_threads()}; microseconds per reply (best of 3)")
    print(f"RSA-2048 peer key: sign {rsa_sign:.0f}, verify {rsa_verify:.0f}")
    ed_key = Ed25519PrivateKey.generate()
    ed_signature = ed_key.sign(message)
    ed_sign = per_call(lambda: ed_key.sign(message), args.seconds)
    ed_public = ed_key.public_key()
    ed_verify = per_call(lambda: ed_public.verify(ed_signature, message), args.seconds)
    print(f"Ed25519 step key: sign {ed_sign:.0f}, verify {ed_verify:.0f}")
    print(f"step-key certificate check, once per session opened: {certificate:.0f}")
    print("hidden  rows  node: hash+sign  gateway: hash+verify")
    for hidden in (576, 4096, 8192):  # SmolLM2-135M, Llama-8B, Llama-70B
        for rows in (1, 8, 64):
            inputs, outputs = torch.randn(rows, 1, hidden), torch.randn(rows, 1, hidden)
            signature = key.sign(statements(inputs, outputs))
            node = per_call(functools.partial(node_side, key, inputs, outputs), args.seconds)
            check = functools.partial(gateway_side, public, identity.peer_id, inputs, outputs, signature)
            gateway = per_call(check, args.seconds)
            print(f"{hidden:6d} {rows:5d} {node:16.0f} {gateway:21.0f}")


if __name__ == "__main__":
    main()
