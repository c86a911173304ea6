"""Routing by the path LP's plan: a policy the gateway does not have, tried in the simulator (issue 27).

``plan_route`` picks the fastest chain with room for each session as it comes. In a KV-bound swarm that fills the
fast chains first and leaves pool fragments that only slow, zigzagging chains connect (``bench/README.md``). The
path LP (``path_lp``) says which chains a swarm's optimum runs and how many sessions each holds (y_c x T_c:
tokens/s times seconds a token, Little's law). Planned routing puts a new session on one of those chains that has
room for it, chosen at random in proportion to those sessions (Helix routes requests by its flow solution's
weights the same way), and when none has room the session waits for room as it does when the swarm is full,
rather than take a chain the plan does not run. Failover patches (part of a chain) are routed by ``plan_route``.

Below the swarm's throughput the LP's optimum is the wrong plan: it spreads sessions over slow chains wherever that
adds throughput nobody asks for (at 0.6x load session rounds 27 % slower than ``plan_route``'s). There the plan is
``path_lp.fastest_plan`` for the offered load at each gateway (its mean over ``DEMAND_WINDOW``, as a gateway
would measure it, times ``DEMAND_MARGIN``), and a session
that finds none of its chains with room goes by ``plan_route``: the swarm has room the plan does not use, and
waiting for a planned chain would refuse sessions an idle swarm could carry. Where the offered load reaches the
optimum (the swarm is KV-bound) there is no such fallback: a chain off the plan takes room from the plan's chains.
"""

from __future__ import annotations

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


def offered_load(times: list[float], offered: list[float], now: float) -> float | None:
    """The offered load (tokens/s) a plan is sized by: the mean of the samples over the last ``DEMAND_WINDOW``
    seconds since the traffic started (none is offered before: a mean over that would size the plan for nothing);
    None where there is none yet."""
    recent = [o for t, o in zip(times, offered, strict=True) if t > now - DEMAND_WINDOW and o > 0]
    return float(np.mean(recent)) if recent else None


class NoPlannedRoom(RuntimeError):
    """No chain of the plan has room for the session now: it waits for room, as in a full swarm."""


@dataclass(frozen=True)
class PlannedChain:
    gateway: int  # index into ``World.gateways``
    hops: tuple[Hop, ...]
    sessions: float  # the LP optimum's sessions on it at once (y_c x T_c)


def pick(
    plan: list[PlannedChain], gateway: int, view: SwarmView, request: RouteRequest, rng: np.random.Generator
) -> list[Hop]:
    """A chain of the plan from ``gateway`` on which every hop's node is online in ``view``, serves the hop, is not
    banned and has room for the session (as ``plan_route`` reads room: the record's ``cache_tokens_left`` or what a
    refusal since taught, whichever is less, against ``max_length``); drawn in proportion to the plan's sessions.
    Raises ``NoPlannedRoom`` where none qualifies."""
    fits = [c for c in plan if c.gateway == gateway and all(_fits(view, request, hop) for hop in c.hops)]
    if not fits:
        raise NoPlannedRoom
    weights = np.array([c.sessions for c in fits])
    return list(fits[int(rng.choice(len(fits), p=weights / weights.sum()))].hops)


def _fits(view: SwarmView, request: RouteRequest, hop: Hop) -> bool:
    server = view.servers.get(hop.peer_id)
    if server is None or server.state is not NodeState.ONLINE or hop.peer_id in request.banned:
        return False
    if not server.start <= hop.start < hop.end == server.end:
        return False  # the node moved since the plan was made
    return cache_room(server, request) >= request.max_length
