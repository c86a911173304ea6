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


def test_a_tree_step_stays_apart_until_its_kept_branch_joins_the_history() -> None:
    segment = Segment(cast(NodeSession, None))
    segment.record(0, chunk(0, 5))
    segment.record(5, chunk(5, 5), tree=[-1, 0, 0, 2, 1])  # the fed token, two drafts below it, one below each
    assert [(p, h.shape[1]) for p, h in segment.history] == [(0, 5)]  # a replacement is replayed the tree apart
    assert segment.tree is not None and segment.tree.parents == [-1, 0, 0, 2, 1]
    segment.record(8, chunk(10, 1), branch=[7, 8])  # slots 5, 7, 8 kept: positions 5, 6, 7
    assert segment.tree is None
    assert [(p, h.shape[1]) for p, h in segment.history] == [(0, 5), (5, 3), (8, 1)]
    assert segment.history[1][1].flatten().tolist() == [5, 7, 8]  # as if the branch had been sent alone


def test_a_truncate_inside_a_tree_keeps_its_first_slots() -> None:
    segment = Segment(cast(NodeSession, None))
    segment.record(0, chunk(0, 5))
    segment.record(5, chunk(5, 4), tree=[-1, 0, 1, 0])
    segment.truncate(7)  # the fed token and the first draft kept in place
    assert segment.tree is None
    assert [(p, h.flatten().tolist()) for p, h in segment.history][1:] == [(5, [5, 6])]
