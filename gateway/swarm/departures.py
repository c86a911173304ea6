"""Nodes that died, froze, or said their record is out of date stay out of routing until they announce again.

A SIGKILLed node's record lingers in the DHT until it expires (tens of seconds); dialling it again only fails again,
and a replay aimed at it is lost time. So a departed node is hidden from every view until its record is newer than
the one it had when it departed — its announcement's expiration time grows with every announcement — whatever that
old record says.

"The record it had" is read from the first view fetched after the departure: a view fetched before it may predate an
announcement the node made just before it died, which would otherwise look like a new one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.swarm.view import SwarmView


@dataclass
class _Departure:
    at: float  # monotonic time of the departure
    stamp: float | None = None  # the expiration of the record it had then; None until a later view shows it


class Departures:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._gone: dict[str, _Departure] = {}

    def depart(self, peer_id: str) -> None:
        self._gone[peer_id] = _Departure(self._clock())

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._gone

    def peers(self) -> frozenset[str]:
        return frozenset(self._gone)

    def filter(self, view: SwarmView) -> SwarmView:
        """``view`` without the departed nodes that have not announced since; those that have are forgotten."""
        hidden = set()
        for peer, gone in list(self._gone.items()):
            stamp = view.announced.get(peer)
            if stamp is None:  # no record at all: it expired; nothing to hide, and the node is forgotten
                if view.fetched_at > gone.at:
                    del self._gone[peer]
                continue
            if gone.stamp is None:
                if view.fetched_at <= gone.at:  # fetched before it departed: cannot tell old from new
                    hidden.add(peer)
                    continue
                gone.stamp = stamp
            if stamp > gone.stamp:
                del self._gone[peer]  # announced again
            else:
                hidden.add(peer)
        if not hidden:
            return view
        servers = {peer: s for peer, s in view.servers.items() if peer not in hidden}
        return SwarmView(view.num_blocks, servers, view.fetched_at, view.announced)
