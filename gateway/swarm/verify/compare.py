"""Whether two outputs of the same blocks on the same inputs agree, within a tolerance.

What is compared: each position's *update* — output minus input, what the blocks added to the residual stream —
by cosine similarity and relative L2 distance (``|a - b| / |a - x|``), the worst position deciding. Comparing the
outputs themselves would let a node that returns its input (``lazy``) pass whenever the span's update is small next
to the residual stream it rides on; the update is what was computed, so that is what is measured.

Both outputs are whole at the gateway (it relayed them or heard them pushed), so no projection or fingerprint is
needed: a seeded projection or a top-k fingerprint is what a checker uses when the outputs must not travel, and it
only loses sensitivity when they are at hand. The receipt (``shared.receipts``) binds the exact tensor by its hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gateway.swarm.verify.tolerances import Tolerance

_EPS = 1e-12  # guards the norms of an all-zero update


@dataclass(frozen=True)
class Comparison:
    cosine: float  # the worst position's cosine similarity of the two updates
    rel_l2: float  # the worst position's |a - b| / |a - x|
    agrees: bool

    def describe(self) -> str:
        return f"cosine {self.cosine:.5f}, relative L2 {self.rel_l2:.5f}"


def compare(inputs: torch.Tensor, expected: torch.Tensor, got: torch.Tensor, tolerance: Tolerance) -> Comparison:
    """inputs, expected, got: [1, T, D] (or [T, D]); ``expected`` from the reference, ``got`` from the checked node."""
    x, a, b = (t.reshape(-1, t.shape[-1]).to(torch.float32) for t in (inputs, expected, got))
    if a.shape != b.shape or a.shape != x.shape:
        return Comparison(0.0, float("inf"), False)  # a node that answers another shape computed something else
    if not bool(torch.isfinite(b).all()):
        return Comparison(0.0, float("inf"), False)
    update_a, update_b = a - x, b - x  # [T, D]
    cosine = torch.nn.functional.cosine_similarity(update_a, update_b, dim=-1, eps=_EPS)  # [T]
    rel = (a - b).norm(dim=-1) / update_a.norm(dim=-1).clamp_min(_EPS)  # [T]
    worst_cosine, worst_rel = float(cosine.min()), float(rel.max())
    agrees = worst_cosine >= tolerance.min_cosine and worst_rel <= tolerance.max_rel_l2
    return Comparison(worst_cosine, worst_rel, agrees)
