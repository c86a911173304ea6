"""One decode step of a chain, pushed node to node: gateway → A → B → … → gateway instead of a relay per node.

The gateway sends the step to the first node with the rest of the route, and asks every later node for its pushed
step at the same moment. Every node answers the gateway (a later one with the input it ran on too), so the gateway
holds each hop's inputs exactly as when it relays, and failover replays them the same way:

* the first node fails: fail it over, then relay the whole step;
* a later node's pushed step does not come within its grace (the push was late, refused or lost), or came with an
  input that is not the previous hop's output: relay from that node on; the node runs a step once whether it came
  by push or by relay, so a push that was only late costs nothing twice;
* a later node fails: fail it over (its replacement is replayed its inputs), then relay from it on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

import torch

from gateway.swarm.router import Router
from gateway.swarm.segment import Segment
from shared.errors import PushMissing


class PushChain(Protocol):
    """What a pushed step needs of its chain (``ChainSession`` is one): its hops, its router, a relayed step from a
    hop on, and failover of a hop."""

    @property
    def segments(self) -> list[Segment]: ...

    @property
    def router(self) -> Router: ...

    async def relay(self, hidden: torch.Tensor, position: int, index: int) -> torch.Tensor: ...

    async def fail_over(self, failed: Segment, error: BaseException) -> None: ...

    def observed(self, segment: Segment, output: torch.Tensor) -> None: ...


# Seconds a pushed hop may take beyond the previous hop's answer (plus two of its round trips) before the gateway
# relays the input itself: long enough for a busy node's forward, short enough that a lost push costs little.
PUSH_GRACE = 1.0


async def push_step(chain: PushChain, hidden: torch.Tensor, position: int) -> torch.Tensor:
    """hidden: [1, 1, D] at ``position`` -> the last block's output [1, 1, D]."""
    segments = list(chain.segments)
    nexts = [segment.session.next_hop for segment in segments[1:]]
    route = [hop for hop in nexts if hop is not None]
    if len(route) != len(nexts) or not all(chain.router.trusted(s.session.hop.peer_id) for s in segments):
        return await chain.relay(hidden, position, 0)  # relaying moves a distrusted node's session first
    first: asyncio.Future[Any] = asyncio.ensure_future(segments[0].session.step(hidden, position, route))
    later: list[asyncio.Future[Any]] = [
        asyncio.ensure_future(segment.session.pushed(position, hidden)) for segment in segments[1:]
    ]
    try:
        try:
            output = await first
        except Exception as error:
            await chain.fail_over(segments[0], error)
            return await chain.relay(hidden, position, 0)
        _done(chain, segments[0], position, hidden, output, pushed=False)
        for index, (segment, future) in enumerate(zip(segments[1:], later, strict=True), start=1):
            grace = PUSH_GRACE + 2 * chain.router.rtts.get(segment.session.hop.peer_id, 0.0)
            try:
                async with asyncio.timeout(grace):  # not wait_for: on 3.11 it may drop a cancel (rpc_client)
                    received, result = await asyncio.shield(future)
                if not torch.equal(received, output):
                    raise PushMissing("the pushed input is not the previous hop's output")
            except (TimeoutError, PushMissing):
                return await chain.relay(output, position, index)
            except Exception as error:
                await chain.fail_over(segment, error)
                return await chain.relay(output, position, index)
            _done(chain, segment, position, received, result, pushed=True)
            output = result
        return output
    finally:
        for future in [first, *later]:
            future.cancel()
            future.add_done_callback(_retrieve)


def _done(
    chain: PushChain, segment: Segment, position: int, received: torch.Tensor, output: torch.Tensor, pushed: bool
) -> None:
    segment.record(position, received)
    chain.observed(segment, output)  # the gateway heard both sides of every pushed hop: checkable like a relay
    chain.router.record_success(segment.session.hop.peer_id)
    if pushed:
        chain.router.stats.pushed_hops += 1
    else:
        chain.router.stats.relayed_hops += 1


def _retrieve(future: asyncio.Future[Any]) -> None:
    """An abandoned pushed step's error is expected (the step went on without it): never logged as unretrieved."""
    if not future.cancelled():
        with contextlib.suppress(Exception):
            future.exception()
