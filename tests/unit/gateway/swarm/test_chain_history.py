"""What a chain remembers of each hop's inputs, so a replacement node is replayed exactly."""

from __future__ import annotations

from typing import cast

import torch

from gateway.swarm.node_session import NodeSession
from gateway.swarm.segment import Segment


def chunk(start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length, dtype=torch.float32).view(1, length, 1)


def test_history_keeps_the_original_chunks_in_order() -> None:
    segment = Segment(cast(NodeSession, None))
    segment.record(0, chunk(0, 5))
    segment.record(5, chunk(5, 1))
    segment.record(6, chunk(6, 1))
    assert [(p, h.shape[1]) for p, h in segment.history] == [(0, 5), (5, 1), (6, 1)]


def test_a_rewind_forgets_everything_from_its_position() -> None:
    segment = Segment(cast(NodeSession, None))
    segment.record(0, chunk(0, 5))
    segment.record(5, chunk(5, 1))
    segment.record(3, chunk(103, 4))  # the client rewinds to position 3 and sends 4 new tokens
    assert [(p, h.shape[1]) for p, h in segment.history] == [(0, 3), (3, 4)]
    assert segment.history[0][1].flatten().tolist() == [0, 1, 2]
    assert segment.history[1][1].flatten().tolist() == [103, 104, 105, 106]


def test_a_truncate_forgets_the_rejected_drafts() -> None:
    segment = Segment(cast(NodeSession, None))
    segment.record(0, chunk(0, 5))
    segment.record(5, chunk(5, 4))  # the last token and three drafts
    segment.truncate(7)  # two kept
    assert [(p, h.shape[1]) for p, h in segment.history] == [(0, 5), (5, 2)]
    assert segment.history[1][1].flatten().tolist() == [5, 6]
    segment.truncate(3)
    assert [(p, h.shape[1]) for p, h in segment.history] == [(0, 3)]
