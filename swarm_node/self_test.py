"""The known-answer test a node runs on its own span after loading it and before its first DHT record.

Two checks, both on seeded inputs (the same on every node, so a failure reproduces):

* **the cache**: hidden states of T positions through a prefill of all T must equal a prefill of T-1 then one
  decode step (within the dtype's tolerance). A cache that keeps no keys/values, a decode path that attends to the
  wrong positions or a layer that ignores the cache we pass all break it; and a forward in which a block stored no
  keys/values raises ``KVNotWritten`` on the spot.
* **quantization**: each quantized block against the same block built in float from the checkpoint's weights, on
  one seeded input (within the quant's tolerance). A broken kernel or a mis-quantized tensor breaks it.

Errors are measured on what a block adds to its input (``output - input``): blocks are residual, so the output's
own norm is mostly the input's and would hide a wrong block.

What it cannot catch: a node whose arithmetic is consistent with itself but wrong (``--faulty-outputs
wrong-weights`` on an unquantized span), one that lies only in what it sends (``noise``, ``lazy``), or one that
announces a precision it does not compute (``low-precision``): those need another replica (the gateway's checks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from shared.errors import KVNotWritten
from shared.weights import WeightReader
from swarm_node.self_test_tolerances import cache_tolerance, quant_tolerance
from swarm_node.span import BlockSpan, build_span

logger = logging.getLogger(__name__)

POSITIONS = 8  # T: long enough to cross the tiny models' sliding windows (5 and 6), short enough to take no time
SEED = 1234


class SelfTestFailed(Exception):
    """The span's known-answer test failed; the message says what, in plain words."""


@dataclass(frozen=True)
class Check:
    name: str
    error: float  # relative error of what the block(s) add to the input
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance  # NaN fails too


def relative_change_error(inputs: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected - inputs||, in float32."""
    inputs, got, expected = inputs.float(), got.float(), expected.float()
    return float((got - expected).norm() / (expected - inputs).norm().clamp_min(1e-12))


def seeded_hidden(span: BlockSpan, positions: int, seed: int = SEED) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, positions, span.hidden_size, generator=generator)
    return hidden.to(span.device, span.cache_dtype)


def cache_check(span: BlockSpan, quant: str = "none") -> Check:
    """Prefill of T positions against prefill of T-1 plus one decode step, over the whole span."""
    blocks = range(span.start, span.end)
    hidden = seeded_hidden(span, POSITIONS)
    whole = span(hidden, [span.new_session_kv(blocks, POSITIONS)], [0], blocks)
    kv = span.new_session_kv(blocks, POSITIONS)
    span(hidden[:, :-1], [kv], [0], blocks)
    step = span(hidden[:, -1:], [kv], [POSITIONS - 1], blocks)
    error = relative_change_error(hidden[:, -1:], step, whole[:, -1:])
    tolerance = cache_tolerance(span.cache_dtype, quant)
    return Check(f"decode after a prefill of {POSITIONS - 1} positions", error, tolerance)


def quant_checks(span: BlockSpan, config: PretrainedConfig, reader: WeightReader, quant: str) -> list[Check]:
    """Each (quantized) block of the span against the same block in float, built from the checkpoint's weights."""
    checks = []
    for block in range(span.start, span.end):
        reference = build_span(config, reader, block, block + 1, span.cache_dtype, span.device)
        hidden = seeded_hidden(span, POSITIONS, SEED + block)
        expected = reference(
            hidden, [reference.new_session_kv(range(block, block + 1), POSITIONS)], [0], range(block, block + 1)
        )
        got = span(hidden, [span.new_session_kv(range(block, block + 1), POSITIONS)], [0], range(block, block + 1))
        error = relative_change_error(hidden, got, expected)
        checks.append(Check(f"block {block} in {quant} against its float weights", error, quant_tolerance(quant)))
    return checks


def run_self_test(span: BlockSpan, config: PretrainedConfig, reader: WeightReader, quant: str) -> list[Check]:
    """All checks (call it on the compute thread); raises ``SelfTestFailed`` naming each one that failed."""
    try:
        checks = [cache_check(span, quant)]
    except KVNotWritten as error:
        raise SelfTestFailed(f"the KV cache is not written: {error}") from error
    if quant != "none":
        checks += quant_checks(span, config, reader, quant)
    failed = [check for check in checks if not check.passed]
    if failed:
        raise SelfTestFailed("; ".join(_describe(check) for check in failed))
    for check in checks:
        logger.info(
            "self-test passed: %s (relative error %.2g, allowed %.2g)", check.name, check.error, check.tolerance
        )
    return checks


def _describe(check: Check) -> str:
    why = " (the KV cache does not keep keys/values?)" if check.name.startswith("decode") else ""
    return f"{check.name} is off by {check.error:.3g} relative, more than the {check.tolerance:.3g} allowed{why}"
