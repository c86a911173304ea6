"""The challenge a node takes before it carries user traffic: seeded random hidden states through its span (as a
session: a prefill, then a decode step), compared with a stateless forward of an established replica over the
blocks they share.

The seed is drawn when the challenge starts, after the node's record was read: the node is committed to its span
and precision before it can know the inputs. The inputs are Gaussian, not real text: a node that can tell a
challenge from traffic can pass it and lie later; spot checks on real steps (``spot_checks``) are what catch that.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from gateway.swarm.verify.compare import Comparison, compare
from gateway.swarm.verify.tolerances import Precision, tolerance_for
from shared.server_records import ServerRecord

CHALLENGE_TOKENS = 8  # positions of a challenge: 7 of prefill, then 1 decode step


@dataclass(frozen=True)
class Challenge:
    seed: int
    blocks: tuple[int, int]  # the blocks the two nodes share
    inputs: torch.Tensor  # [1, T, D]


def overlap(a: ServerRecord, b: ServerRecord) -> tuple[int, int] | None:
    start, end = max(a.start, b.start), min(a.end, b.end)
    return (start, end) if start < end else None


def new_challenge(blocks: tuple[int, int], hidden_size: int, dtype: torch.dtype, tokens: int) -> Challenge:
    seed = secrets.randbits(63)  # drawn now: after the node announced what it serves
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(1, tokens, hidden_size, generator=generator).to(dtype)
    return Challenge(seed, blocks, inputs)


def judge(
    challenge: Challenge, candidate: ServerRecord, reference: ServerRecord, got: torch.Tensor, want: torch.Tensor
) -> Comparison:
    tolerance = tolerance_for(Precision.parse(candidate.precision), Precision.parse(reference.precision))
    return compare(challenge.inputs, want, got, tolerance)


def reference_order(candidate: ServerRecord, server: ServerRecord, reputation: float) -> tuple[int, int, float]:
    """Sort key of possible references (largest first): more shared blocks, more precise, more reputed."""
    shared = overlap(candidate, server)
    width = 0 if shared is None else shared[1] - shared[0]
    return width, Precision.parse(server.precision).rank, reputation
