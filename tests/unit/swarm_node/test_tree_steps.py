"""Tree steps (speculative branches verified in one forward) against chains of each branch alone, for every family.

A tree step's output at each token equals what a chain step of that token's branch alone gives; keeping one branch
leaves exactly the keys and values a chain of that branch would have written, and the next step goes on from there.
"""

from __future__ import annotations

import pytest
import torch

from swarm_node.kv_cache import SessionKV, check_branch, tree_depths
from tests.tiny_models import TinyModel
from tests.unit.swarm_node.test_span_exactness import ATOL, Chain, build_chain, random_ids

PROMPT = 10  # longer than the tiny models' sliding windows: the window applies to a tree's depth positions
# A root (the last emitted token) and three branches of different depths, some forking below the root.
PARENTS = [-1, 0, 1, 0, 3, 4, 1, 2]
LEAVES = [5, 6, 7]


def path_to(node: int) -> list[int]:
    path = [node]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def tree_step(chain: Chain, token_ids: torch.Tensor, session: list[SessionKV], start: int) -> torch.Tensor:
    """token_ids [1, T] laid out as PARENTS -> logits [1, T, V]."""
    hidden = chain.head.embed(token_ids)
    for span, kv in zip(chain.spans, session, strict=True):
        hidden = span(hidden, [kv], [start], range(span.start, span.end), parents=PARENTS)
    return chain.head.logits(hidden)


@pytest.fixture
def tiny(tiny_model, tiny_variant: str) -> TinyModel:  # type: ignore[no-untyped-def]
    return tiny_model(tiny_variant)


def test_each_branch_of_a_tree_step_equals_its_chain_alone(tiny: TinyModel) -> None:
    chain = build_chain(tiny.folder, (2,))
    prompt, tokens = random_ids(PROMPT, seed=1), random_ids(len(PARENTS), seed=2)
    session = chain.new_session()
    chain.step(prompt, session, 0)
    tree = tree_step(chain, tokens, session, PROMPT)
    assert all(kv.length == PROMPT + len(PARENTS) for kv in session)  # every tree token stored, provisionally
    for leaf in LEAVES:
        path = path_to(leaf)
        alone = chain.new_session()
        chain.step(prompt, alone, 0)
        expected = chain.step(tokens[:, path], alone, PROMPT)
        torch.testing.assert_close(tree[:, path], expected, atol=ATOL, rtol=0)


def test_keeping_a_branch_leaves_the_cache_of_that_chain(tiny: TinyModel) -> None:
    chain = build_chain(tiny.folder, (3,))
    prompt, tokens = random_ids(PROMPT, seed=3), random_ids(len(PARENTS), seed=4)
    path = path_to(5)  # [0, 3, 4, 5]: not the tree's first slots, so keeping it moves keys
    session = chain.new_session()
    chain.step(prompt, session, 0)
    tree_step(chain, tokens, session, PROMPT)
    slots = [PROMPT + node for node in path]
    for kv in session:
        assert check_branch(kv.length, PROMPT, slots) is None
        kv.keep_branch(PROMPT, slots)

    alone = chain.new_session()
    chain.step(prompt, alone, 0)
    chain.step(tokens[:, path], alone, PROMPT)
    end = PROMPT + len(path)
    for kept, expected in zip(session, alone, strict=True):
        assert kept.length == expected.length == end
        torch.testing.assert_close(kept.keys[:, :, :end], expected.keys[:, :, :end], atol=ATOL, rtol=0)
        torch.testing.assert_close(kept.values[:, :, :end], expected.values[:, :, :end], atol=ATOL, rtol=0)
    following = torch.tensor([[7]])
    torch.testing.assert_close(
        chain.step(following, session, end), chain.step(following, alone, end), atol=ATOL, rtol=0
    )


def test_malformed_trees_and_branches_are_refused() -> None:
    assert tree_depths([-1, 0, 0, 2, -1]) == [0, 1, 1, 2, 0]
    with pytest.raises(ValueError):
        tree_depths([-1, 1])  # its own parent
    with pytest.raises(ValueError):
        tree_depths([-1, 2, 0])  # a parent after its child
    assert check_branch(20, 10, [10, 13, 14]) is None
    assert check_branch(20, 10, [10, 14, 13]) is not None  # not ascending
    assert check_branch(20, 10, [9, 13]) is not None  # a slot before its new position
    assert check_branch(14, 10, [10, 14]) is not None  # past the stored tokens
    assert check_branch(20, -1, [3]) is not None
