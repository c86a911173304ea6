"""Comparing two outputs of the same blocks: tolerances by precision, and what honest and lying outputs give."""

from __future__ import annotations

import torch

from gateway.swarm.verify.compare import compare
from gateway.swarm.verify.tolerances import FLOAT32, HALF, INT8, NF4, Precision, tolerance_for


def _step() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(1, 8, 64, generator=generator)
    return inputs, inputs + 0.5 * torch.randn(1, 8, 64, generator=generator)  # the blocks' update: half the input


def test_the_same_output_agrees_and_lies_do_not() -> None:
    inputs, output = _step()
    assert compare(inputs, output, output.clone(), FLOAT32).agrees
    noisy = output + 0.01 * output.norm(dim=-1, keepdim=True) / 8 * torch.randn(1, 8, 64)  # ~1 % of each row
    assert not compare(inputs, output, noisy, FLOAT32).agrees
    lazy = compare(inputs, output, inputs.clone(), NF4)  # returns its input: no update at all
    assert not lazy.agrees and lazy.rel_l2 == 1.0
    stale = output.clone()
    stale[:, -1] = inputs[:, -1] + 0.5 * torch.randn(64)  # only the decode position is wrong
    assert not compare(inputs, output, stale, INT8).agrees
    assert not compare(inputs, output, output[:, :4], NF4).agrees  # another shape
    assert not compare(inputs, output, torch.full_like(output, float("nan")), NF4).agrees


def test_a_pair_is_held_to_its_looser_side() -> None:
    f32, bf16 = Precision.parse("none/float32/cpu"), Precision.parse("none/bfloat16/cuda")
    int8, nf4 = Precision.parse("int8/float32/cpu"), Precision.parse("nf4/bfloat16/cuda")
    assert tolerance_for(f32, f32) == FLOAT32
    assert tolerance_for(f32, bf16) == HALF
    assert tolerance_for(int8, f32) == INT8
    assert tolerance_for(nf4, int8) == NF4
    assert tolerance_for(f32, Precision.parse("none/float32/cuda")) == HALF  # other kernels, TF32
    assert Precision.parse(None) == f32 and Precision.parse("garbage") == f32  # saying less buys no slack
    assert nf4.rank < int8.rank < bf16.rank < f32.rank
