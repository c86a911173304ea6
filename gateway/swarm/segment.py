"""One hop of a chain (its node session) and every input it was given, kept so a replacement can be replayed.

A tree step (speculative branches, ``Step.tree``) is kept apart from the chain of inputs until the next step says
which branch stays (``keep_branch``): then that branch's rows join the chain, as if it had been sent alone — the
node's cache holds exactly what that chain would have written. A replacement is replayed the chain, then the tree."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gateway.swarm.node_session import NodeSession, TreeInput


@dataclass
class Segment:
    """One hop of a chain and every input it was given, kept so a replacement can be replayed exactly."""

    session: NodeSession
    history: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, hidden [1, T, D])
    tree: TreeInput | None = None  # the last step, when it was a tree: its branches held provisionally

    def record(
        self, position: int, hidden: torch.Tensor, tree: list[int] | None = None, branch: list[int] | None = None
    ) -> None:
        """Remember an input (``tree``: its parents); ``branch`` first keeps one branch of the tree before it, and
        inputs at or after ``position`` are forgotten (the node rewinds the same way)."""
        if branch:
            self.keep_branch(position, branch)
        self.truncate(position)
        if tree is not None:
            self.tree = TreeInput(position, hidden, tree)
        else:
            self.history.append((position, hidden))

    def keep_branch(self, end: int, branch: list[int]) -> None:
        """The tree's tokens at slots ``branch`` become the positions before ``end``; its tokens before them stay
        where they are: those rows join the chain of inputs, the tree goes."""
        tree = self.tree
        if tree is None:
            raise ValueError("no tree step to keep a branch of")
        moved = end - len(branch)
        slots = [*range(tree.position, moved), *branch]
        rows = [slot - tree.position for slot in slots]
        if any(not 0 <= row < tree.hidden.shape[1] for row in rows):
            raise ValueError(f"branch slots {branch} are not the tree's at {tree.position}")
        self.tree = None
        self._truncate_chain(tree.position)
        if rows:
            self.history.append((tree.position, tree.hidden[:, rows]))

    def truncate(self, length: int) -> None:
        """Forget the inputs from position ``length`` on (the node was rolled back there); a tree's tokens before
        ``length`` stay where they are (the chain of the tree's first tokens: the gateway sends a branch otherwise)."""
        if self.tree is not None:
            self.keep_branch(max(length, self.tree.position), [])
        self._truncate_chain(length)

    def _truncate_chain(self, length: int) -> None:
        kept = []
        for start, chunk in self.history:
            if start >= length:
                break
            kept.append((start, chunk[:, : length - start]))
        self.history = kept
