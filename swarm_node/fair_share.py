"""Fair share of a node between the peers that use it: in a public swarm anyone can run a gateway, and one must not
starve the others.

What one peer (the caller's peer id as the RPC handler sees it; a session's steps count for the peer that opened
it, whoever pushes them) may hold is capped — its open sessions, the cache tokens they hold, its steps queued or
running — but only while *another* peer is active (holds a session, or has a step queued) or waits for room in
the pool (its open asked to wait, ``alloc_timeout``). A peer alone on a node may use all of it; once
another comes, it may keep what it holds but not take more beyond its share, so the room its sessions free goes to
the others. Over the limit the answer is ``CacheFull``: retryable, so a gateway routes to another node or retries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from shared.errors import CacheFull


@dataclass(frozen=True)
class ShareLimits:
    cache_share: float = 0.5  # of the pool's tokens one peer may hold while others use the node or wait
    max_sessions: int = 128  # open sessions of one peer, likewise
    max_queued_steps: int = 64  # steps of one peer queued or running at once, likewise (2x the default batch)


@dataclass(frozen=True)
class Holding:
    sessions: int = 0
    tokens: int = 0


class FairShare:
    """``holdings()``: each peer's open sessions and their cache tokens (read from the session registry, so the
    accounting cannot drift from what is really held); steps in flight are counted here."""

    def __init__(
        self,
        limits: ShareLimits,
        pool_tokens: int,
        holdings: Callable[[], dict[str, Holding]],
    ) -> None:
        self.limits, self.pool_tokens = limits, pool_tokens
        self._holdings = holdings
        self._steps: Counter[str] = Counter()  # peer -> its steps queued or running
        self._waiting: Counter[str] = Counter()  # peer -> its opens waiting for room in the pool

    def contended(self, peer: str) -> bool:
        """Another peer holds a session, has a step in flight, or waits for room."""
        others = set(self._holdings()) | set(+self._steps) | set(+self._waiting)
        return bool(others - {peer})

    def check_room(self, peer: str, tokens: int, new_session: bool) -> None:
        """Before granting ``peer`` ``tokens`` more of the pool (a new session's, or a session's growth)."""
        if not self.contended(peer):
            return
        held = self._holdings().get(peer, Holding())
        share = int(self.limits.cache_share * self.pool_tokens)
        if held.tokens + tokens > share:
            raise CacheFull(
                f"peer {peer} holds {held.tokens} cache tokens; {tokens} more would exceed its fair share of {share}"
                " while other peers use this node"
            )
        if new_session and held.sessions + 1 > self.limits.max_sessions:
            raise CacheFull(
                f"peer {peer} holds {held.sessions} sessions, the most one peer may while other peers use this node"
            )

    @contextmanager
    def waiting(self, peer: str) -> Iterator[None]:
        """``peer`` waits for room in the pool during the body: peers over their share take no more meanwhile."""
        self._waiting[peer] += 1
        try:
            yield
        finally:
            self._waiting[peer] -= 1

    @contextmanager
    def step(self, peer: str) -> Iterator[None]:
        """Count one step of ``peer`` in flight for the body; refused over the limit while others are active."""
        queued = self._steps[peer]
        if queued >= self.limits.max_queued_steps and self.contended(peer):
            raise CacheFull(f"peer {peer} has {queued} steps queued, the most one peer may while others use this node")
        self._steps[peer] += 1
        try:
            yield
        finally:
            self._steps[peer] -= 1
