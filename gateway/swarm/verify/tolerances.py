"""How far two honest replicas of the same blocks may differ, by how each computes: (quant, dtype, device class).

A node announces its precision (``ServerRecord.precision``, "quant/dtype/device"); a pair is held to the tolerance
of its looser side. A node that announces nothing is held to float32's (a lying node must not gain slack by
saying less); two float32 nodes on different device classes (CPU and CUDA: TF32, other kernels) to bfloat16's.

How the numbers were measured (CPU, torch threads 1, 2026-12-01), on SmolLM2-135M (its GGUF dequantized, then
quantized again by bitsandbytes for int8/nf4), replicas none/float32, none/bfloat16, int8/float32, nf4/float32 and
nf4/bfloat16, 8 positions, every replica's session output (a prefill of 7, then one decode step) against every
replica's stateless forward, the worst position deciding:

* blocks 0:4, 10:16 and 24:30, inputs the embeddings of seeded random tokens carried through the float32 blocks
  before the span, 10 / 5 / 5 seeds (a script over ``bench.verify_spans``);
* blocks 0:2, 6:8, 14:16, 22:24 and 28:30, inputs the embeddings themselves, 4 seeds
  (``python -m bench.verify --quick --spans 0:2,6:8,14:16,22:24,28:30``); nf4 against int8 over SmolLM2's last
  blocks was the worst pair of all.

    pair (looser side)      min cosine   max relative L2     tolerance (cosine >=, rel L2 <=)
    float32 / float32       1.000000     < 1e-5              0.9999, 0.005
    bfloat16 (either)       0.998865     0.064               0.99,   0.20
    int8 (either)           0.982003     0.274               0.95,   0.60
    nf4 (either)            0.714930     0.908               0.50,   1.60

Each tolerance leaves about 2x (3x for float32's: other CPUs' kernels) over the worst measured honest pair, and
``make bench-verify`` counts honest pairs flagged over 10,000 comparisons (bench/results/verify.md). What that buys and
costs: a node that adds 1 % noise moves the update by >= 1 % and is caught against a float32 replica, not against
an nf4 one (1 % hides inside nf4's own error); the checker therefore prefers the most precise replica it has.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    min_cosine: float
    max_rel_l2: float


# Looser first: a pair takes the first class either side falls in.
FLOAT32 = Tolerance(0.9999, 0.005)
HALF = Tolerance(0.99, 0.20)
INT8 = Tolerance(0.95, 0.60)
NF4 = Tolerance(0.50, 1.60)
_BY_CLASS = {"nf4": NF4, "int8": INT8, "half": HALF, "float32": FLOAT32}
_ORDER = ["nf4", "int8", "half", "float32"]
_HALF_DTYPES = {"bfloat16", "float16"}


@dataclass(frozen=True)
class Precision:
    quant: str = "none"
    dtype: str = "float32"
    device: str = "cpu"

    @classmethod
    def parse(cls, announced: str | None) -> Precision:
        """From a record's "quant/dtype/device"; anything unreadable is float32 on the CPU (the strictest)."""
        parts = (announced or "").split("/")
        return cls(*parts) if len(parts) == 3 and all(parts) else cls()

    @property
    def error_class(self) -> str:
        if self.quant in ("nf4", "int8"):
            return self.quant
        return "half" if self.dtype in _HALF_DTYPES else "float32"

    @property
    def rank(self) -> int:
        """Higher is more precise (a checker prefers references of the highest rank)."""
        return _ORDER.index(self.error_class)

    def __str__(self) -> str:
        return f"{self.quant}/{self.dtype}/{self.device}"


def tolerance_for(a: Precision, b: Precision) -> Tolerance:
    """The tolerance two replicas computing as ``a`` and ``b`` are held to."""
    classes = {a.error_class, b.error_class}
    if classes == {"float32"} and a.device != b.device:
        classes = {"half"}
    loosest = min(classes, key=_ORDER.index)
    return _BY_CLASS[loosest]
