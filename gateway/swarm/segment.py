"""One hop of a chain (its node session) and every input it was given, kept so a replacement can be replayed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gateway.swarm.node_session import NodeSession


@dataclass
class Segment:
    """One hop of a chain and every input it was given, kept so a replacement can be replayed exactly."""

    session: NodeSession
    history: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, hidden [1, T, D])

    def record(self, position: int, hidden: torch.Tensor) -> None:
        """Remember an input; inputs at or after ``position`` are forgotten first (the node rewinds the same way)."""
        self.truncate(position)
        self.history.append((position, hidden))

    def truncate(self, length: int) -> None:
        """Forget the inputs from position ``length`` on (the node was rolled back there)."""
        kept = []
        for start, chunk in self.history:
            if start >= length:
                break
            kept.append((start, chunk[:, : length - start]))
        self.history = kept
