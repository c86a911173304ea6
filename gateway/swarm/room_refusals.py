"""Nodes that refused a session for want of room, remembered until they announce a record newer than the refusal.

A node's record says how much cache room it had when it announced, up to an announce period ago (10 s, and a view
may be older still). In a busy swarm that room is gone long before the record says so: every open routed on the
record is refused, and the next open trusts the same record again (the simulator counted 37,141 of 52,780 open
refusals of a 100-node 70B run going to such nodes). So a refusal is remembered: until the node's record is newer
than the refusal, routing reads its room as less than the smallest session it refused, through the same cache-short
penalty it gives a record that says so itself (``routing.RouteRequest.room_left``). Smaller sessions may still go
there, and a node that is the only one serving a block is still used (the penalty is a price, not a ban).

"Newer than the refusal" is read as ``departures`` reads it: the record's expiration (it grows with every
announcement) against the one the first view fetched after the refusal shows; a record announced between the
refusal and that fetch counts as old, which costs at most one more announce period. Capacity is never a fault: no
ban, no reputation.

``REFUSAL_BOUND`` caps the memory should no newer record come (a node whose announcements stop reaching us while its
old record lingers): 30 s, three announce periods (``ROUTE_STALE_OK`` too), after which a healthy node has announced
twice over and a record without a newer one has expired from the DHT (its TTL is 25 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.swarm.view import SwarmView

REFUSAL_BOUND = 30.0  # seconds a refusal is remembered at most (see the module docstring)


@dataclass
class _Refusal:
    at: float  # clock time of the latest refusal
    tokens: int  # the smallest session refused since the node last announced
    stamp: float | None = None  # the expiration of its record then; None until a view fetched after ``at`` shows it


class RoomRefusals:
    def __init__(self, clock: Callable[[], float] = time.monotonic, bound: float = REFUSAL_BOUND) -> None:
        self._clock = clock
        self._bound = bound
        self._refused: dict[str, _Refusal] = {}

    def refuse(self, peer_id: str, tokens: int) -> None:
        """``peer_id`` refused a session of ``tokens`` tokens for want of room."""
        old = self._refused.get(peer_id)
        smallest = tokens if old is None else min(tokens, old.tokens)
        self._refused[peer_id] = _Refusal(self._clock(), smallest)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._refused

    def room_left(self, view: SwarmView) -> dict[str, int]:
        """Per node whose record in ``view`` is not newer than its refusal: the most tokens it may have room for
        (one less than the smallest session it refused). Refusals that a newer record, an expired record or the
        bound have answered are forgotten."""
        now = self._clock()
        left: dict[str, int] = {}
        for peer, refusal in list(self._refused.items()):
            if self._answered(peer, refusal, view, now):
                del self._refused[peer]
            else:
                left[peer] = refusal.tokens - 1
        return left

    def _answered(self, peer: str, refusal: _Refusal, view: SwarmView, now: float) -> bool:
        if now - refusal.at >= self._bound:
            return True
        stamp = view.announced.get(peer)
        if stamp is None:  # no record in a view fetched since: it expired (nothing to route on anyway)
            return view.fetched_at > refusal.at
        if refusal.stamp is None:
            if view.fetched_at <= refusal.at:  # fetched before the refusal: cannot tell old from new
                return False
            refusal.stamp = stamp
        return stamp > refusal.stamp
