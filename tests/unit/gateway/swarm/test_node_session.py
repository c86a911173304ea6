"""``NodeSession`` after its stream broke (a read failed, as when a pipelined frame finds its node frozen): a step
by the step links fails at once as unreachable, so the chain fails the hop over instead of waiting out the liveness
watch on the same node a second time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from gateway.swarm.node_session import NodeSession
from gateway.swarm.routing import Hop
from gateway.swarm.step_links import StepLinks
from shared.errors import NodeUnreachable
from shared.receipts import ReceiptCheck


class Links:
    """The step links, answering every step (the node behind them is alive as far as they know)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    async def step(self, receipts: Any, hidden: torch.Tensor, position: int, next: Any) -> Any:
        self.steps.append(position)
        return SimpleNamespace(output=hidden + 1, receipt=None)

    async def pushed(self, receipts: Any, position: int, seconds: float, tokens: int) -> Any:
        self.steps.append(position)
        like = torch.zeros(1, tokens, 2)
        return SimpleNamespace(input=like, output=like + 1, receipt=None)


async def frozen_replies() -> AsyncIterator[runtime_pb2.ExpertResponse]:
    raise NodeUnreachable("node peer answers no ping within 3s (frozen?)")
    yield runtime_pb2.ExpertResponse()  # an async generator


async def test_a_session_whose_stream_broke_takes_no_step_by_the_links() -> None:
    links = Links()
    session = NodeSession(cast(P2P, None), Hop("peer", 0, 3), 64, 30.0, links=cast(StepLinks, links))
    session._receipts = cast(ReceiptCheck, object())  # opened: the node certified its step key
    session._stepped = True  # its prompt went: a verify step of a few tokens goes by the links
    session._replies = frozen_replies()
    hidden = torch.zeros(1, 3, 2)
    assert torch.equal(await session.step(hidden, 7), hidden + 1) and links.steps == [7]
    with pytest.raises(NodeUnreachable, match="frozen"):
        await session.send_step(hidden, 10)  # a frame on the session's own stream: the read fails
    with pytest.raises(NodeUnreachable, match="lost its stream"):
        await session.step(hidden, 10)  # the same step again, unpipelined
    with pytest.raises(NodeUnreachable, match="lost its stream"):
        await session.pushed(10, hidden[:, :1])
    assert links.steps == [7]
