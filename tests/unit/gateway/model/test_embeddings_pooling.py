"""Pooling and the batched prefills of ``gateway.model.embeddings``, on plain tensors (the swarm's side:
tests/integration/test_embeddings_smollm2.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from gateway.model.embeddings import embed_inputs, pooled
from shared.errors import CacheFull


def test_last_and_mean_pooling_of_the_normed_states_have_unit_length() -> None:
    torch.manual_seed(0)
    output = torch.randn(1, 5, 8)
    norm = nn.LayerNorm(8)
    normed = norm(output)[0]
    last = torch.tensor(pooled(output, norm, "last"))
    mean = torch.tensor(pooled(output, norm, "mean"))
    assert torch.allclose(last, nn.functional.normalize(normed[-1], dim=0), atol=1e-6)
    assert torch.allclose(mean, nn.functional.normalize(normed.mean(0), dim=0), atol=1e-6)
    assert not torch.allclose(last, mean)


async def test_inputs_come_back_in_order_and_the_first_failure_is_raised_typed() -> None:
    started: list[int] = []
    cancelled: list[int] = []

    async def prefill(ids: Sequence[int], adapter: str | None) -> torch.Tensor:
        started.append(ids[0])
        try:
            await asyncio.sleep(0.01 * (5 - ids[0]))  # later inputs finish first
        except asyncio.CancelledError:
            cancelled.append(ids[0])
            raise
        if ids[0] == 99:
            raise CacheFull("no room")
        output = torch.zeros(1, len(ids), 4)
        output[0, -1, ids[0]] = 2.0  # the last position points along axis ids[0]
        return output

    vectors = await embed_inputs(prefill, [[1], [2, 2], [3]], nn.Identity(), "last", None)
    assert vectors == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]  # in order, unit length
    assert sorted(started) == [1, 2, 3]
    with pytest.raises(CacheFull):
        await embed_inputs(prefill, [[99], [0], [-5]], nn.Identity(), "last", None)
    assert set(cancelled) == {0, -5}  # the others stopped (each closes its own chain)
