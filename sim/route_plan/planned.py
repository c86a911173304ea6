"""Routing by the path LP's plan (issue 27): sessions drawn onto a plan's chains, and the demand a plan is sized by.

``plan_route`` picks the fastest chain with room for each session as it comes. In a KV-bound swarm that fills the
fast chains first and leaves pool fragments that only slow, zigzagging chains connect (``bench/README.md``). The
path LP (``path_lp``) says which chains a swarm's optimum runs and how many sessions each holds (y_c x T_c:
tokens/s times seconds a token, Little's law). Planned routing puts a new session on one of those chains that has
room for it, chosen at random in proportion to those sessions (Helix routes requests by its flow solution's
weights the same way), and when none has room the session waits for room as it does when the swarm is full,
rather than take a chain the plan does not run. Failover patches (part of a chain) are routed by ``plan_route``.

Below the swarm's throughput the LP's optimum is the wrong plan: it spreads sessions over slow chains wherever that
adds throughput nobody asks for (at 0.6x load session rounds 27 % slower than ``plan_route``'s). There the plan is
``path_lp.fastest_plan`` for the gateway's offered load (``DemandMeter``: its mean over ``DEMAND_WINDOW``, times
``DEMAND_MARGIN``), and a session that finds none of its chains with room goes by ``plan_route``: the swarm has
room the plan does not use, and waiting for a planned chain would refuse sessions an idle swarm could carry. Where
the offered load reaches the optimum (the swarm is KV-bound) there is no such fallback: a chain off the plan takes
room from the plan's chains. ``view_plan`` makes a gateway's plan.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.swarm.routing import Hop, RouteRequest, cache_room
from gateway.swarm.view import SwarmView
from shared.server_records import NodeState

DEMAND_MARGIN = 1.1  # the demand plan carries this multiple of the offered load (bursts, and the draw's spread)
# The offered load a plan is sized by: its mean over this many seconds. A burst's arrivals go by ``plan_route``
# where the plan has no room; a plan for the burst's peak would be the optimum's slow chains, and sessions opened
# on them keep them for their whole length.
DEMAND_WINDOW = 300.0
FINISHED_KEPT = 500  # finished sessions whose decoded tokens give the mean length a demand is sized by
# A session that found no room this recently says the swarm is full: plan for the optimum. (The LP's figure cannot
# say so: a record gives one session's speed, not a full batch's, so the plan has no compute rows and the LP carries
# more than the swarm can.)
ROOM_WINDOW = 60.0
PLAN_PERIOD = 30.0  # seconds between a gateway's plans (each a path LP over its view: seconds of CPU at scale)


class DemandMeter:
    """What a gateway's users ask of the swarm, as the gateway measures it: sessions arriving per second over the
    last ``DEMAND_WINDOW`` seconds (since the first: a mean over time before any would size the plan for nothing)
    times the mean tokens decoded by the last ``FINISHED_KEPT`` sessions to finish, in tokens/s; and the mean
    ``max_length`` of those arrivals (what a session holds on a node). Arrivals count whether or not the swarm had
    room for them (decoded tokens/s alone would read a full swarm's refusals as less demand); the finished are
    counted over more than the window, or long sessions, which outlast it, would be left out."""

    def __init__(self) -> None:
        self._opened: deque[tuple[float, int]] = deque()  # (time, max_length)
        self._finished: deque[int] = deque(maxlen=FINISHED_KEPT)  # tokens decoded
        self._first: float | None = None
        self._short = -float("inf")  # when a session last found no room

    def short_of_room(self, now: float) -> None:
        """A session found no room for its chain (a node refused it for room, or no planned chain had any)."""
        self._short = now

    def opened(self, max_length: int, now: float) -> None:
        self._first = now if self._first is None else self._first
        self._opened.append((now, max_length))

    def finished(self, tokens: int) -> None:
        self._finished.append(tokens)

    def demand(self, now: float) -> float | None:
        """Tokens/s; None (plan for the optimum) before a session arrived in the window and one finished, and while
        a session found no room in the last ``ROOM_WINDOW`` seconds."""
        self._forget(now)
        if now - self._short < ROOM_WINDOW:
            return None
        if self._first is None or not self._opened or not self._finished or now <= self._first:
            return None
        arrivals = len(self._opened) / min(DEMAND_WINDOW, now - self._first)
        return arrivals * sum(self._finished) / len(self._finished)

    def held_length(self, now: float) -> float | None:
        """The mean ``max_length`` of the sessions that arrived in the window; None where none did."""
        self._forget(now)
        return sum(n for _, n in self._opened) / len(self._opened) if self._opened else None

    def _forget(self, now: float) -> None:
        while self._opened and self._opened[0][0] <= now - DEMAND_WINDOW:
            self._opened.popleft()


class NoPlannedRoom(RuntimeError):
    """No chain of the plan has room for the session now: it waits for room, as in a full swarm."""


@dataclass(frozen=True)
class PlannedChain:
    gateway: int  # which of the plan's gateways (an index)
    hops: tuple[Hop, ...]
    sessions: float  # the LP optimum's sessions on it at once (y_c x T_c)


def pick(plan: Sequence[PlannedChain], view: SwarmView, request: RouteRequest, rng: np.random.Generator) -> list[Hop]:
    """A chain of the plan on which every hop's node is online in ``view``, serves the hop, is neither banned nor
    excluded and has room for the session (as ``plan_route`` reads room: the record's ``cache_tokens_left`` or what a
    refusal since taught, whichever is less, against ``max_length``); drawn in proportion to the plan's sessions.
    Raises ``NoPlannedRoom`` where none qualifies."""
    fits = [c for c in plan if all(_fits(view, request, hop) for hop in c.hops)]
    if not fits:
        raise NoPlannedRoom
    weights = np.array([c.sessions for c in fits])
    return list(fits[int(rng.choice(len(fits), p=weights / weights.sum()))].hops)


def _fits(view: SwarmView, request: RouteRequest, hop: Hop) -> bool:
    server = view.servers.get(hop.peer_id)
    if server is None or server.state is not NodeState.ONLINE:
        return False
    if hop.peer_id in request.banned or hop.peer_id in request.excluded:
        return False
    if not server.start <= hop.start < hop.end == server.end:
        return False  # the node moved since the plan was made
    return cache_room(server, request) >= request.max_length
