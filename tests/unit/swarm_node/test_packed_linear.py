"""The prepacked linear layer the LM head scores with: nn.Linear's results, each row independent of its batch."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from shared.packed_linear import PackedLinear, packable


@pytest.mark.parametrize("bias", [False, True])
def test_equals_linear_and_each_row_is_the_same_in_any_batch(bias: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 64, generator=generator)
    offset = torch.randn(300, generator=generator) if bias else None
    layer = PackedLinear(weight, offset)
    assert layer.uses_onednn == torch.backends.mkldnn.is_available()
    rows = torch.randn(8, 1, 64, generator=generator)  # [B, T, D] like decode hidden states
    batched = layer(rows)
    assert batched.shape == (8, 1, 300)
    torch.testing.assert_close(batched, functional.linear(rows, weight, offset), atol=1e-4, rtol=1e-5)
    for index in range(8):  # bit for bit: batching never changes a session's logits
        assert torch.equal(layer(rows[index : index + 1]), batched[index : index + 1])


def test_other_dtypes_are_a_plain_linear() -> None:
    weight = torch.randn(10, 4, dtype=torch.bfloat16)
    layer = PackedLinear(weight)
    assert not packable(torch.bfloat16, torch.device("cpu")) and not layer.uses_onednn
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(layer(x), functional.linear(x, weight))
