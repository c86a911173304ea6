"""Pipelined verify frames (``gateway.swarm.frames``) over fake node sessions whose answers the test hands out.

Checked: a frame reaches each hop only after the frame before it was sent there; histories stay in position order
even when a later frame's answer is handled first; a frame ahead of one that failed is void (sends nothing more,
records nothing), while a frame that is not ahead goes on after a void one (it rewinds); ``void`` stops a frame
before its next hop; an error or a distrusted node voids a frame (it returns None, never raises).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from gateway.swarm.chain_session import ChainSession
from gateway.swarm.frames import Frame
from gateway.swarm.segment import Segment
from shared.errors import NodeDistrusted, NodeUnreachable


class FakeSession:
    """A node session whose frame answers the test resolves, by the order the frames were sent in; an ordinary
    step (``step``) is answered at once."""

    def __init__(self, name: str) -> None:
        self.hop = SimpleNamespace(peer_id=name)
        self.closed = False
        self.last_receipt = None
        self.sent: list[int] = []  # positions, in send order
        self.answers: list[asyncio.Future[torch.Tensor]] = []
        self.stepped: list[int] = []  # positions of ordinary steps

    async def step(self, hidden: torch.Tensor, position: int, **_: Any) -> torch.Tensor:
        self.stepped.append(position)
        return hidden + 1

    def send_step(self, hidden: torch.Tensor, position: int) -> Any:
        self.sent.append(position)
        self.answers.append(asyncio.get_running_loop().create_future())
        return self._answer(self.answers[-1])  # type: ignore[arg-type]

    async def _answer(self, future: asyncio.Future[torch.Tensor]) -> torch.Tensor:
        output = await future
        self.last_receipt = ("receipt", float(output.flatten()[0]))  # as NodeSession sets it on each answer
        return output

    def answer(self, sent: int, value: torch.Tensor | Exception) -> None:
        if isinstance(value, Exception):
            self.answers[sent].set_exception(value)
        else:
            self.answers[sent].set_result(value)


@dataclass
class FakeChain:
    distrusted: set[str] = field(default_factory=set)
    successes: list[str] = field(default_factory=list)
    receipts: list[tuple[str, int, object]] = field(default_factory=list)  # (hop, position, receipt) observed

    @property
    def router(self) -> Any:
        return SimpleNamespace(record_success=self.successes.append, stats=SimpleNamespace(relayed_hops=0))

    def check_trusted(self, segment: Segment) -> None:
        if segment.session.hop.peer_id in self.distrusted:
            raise NodeDistrusted("out of routing")

    def observed(self, segment: Segment, output: torch.Tensor, receipt: object = None) -> None:
        self.receipts.append((segment.session.hop.peer_id, segment.history[-1][0], receipt))


def hidden(tokens: int, value: float) -> torch.Tensor:
    return torch.full((1, tokens, 2), value)


def hops(*names: str) -> tuple[list[FakeSession], list[Segment]]:
    sessions = [FakeSession(name) for name in names]
    return sessions, [Segment(session) for session in sessions]  # type: ignore[arg-type]


async def settled() -> None:
    for _ in range(10):  # let every ready task run to its next wait (no timing involved)
        await asyncio.sleep(0)


def two_frames(chain: FakeChain, tokens: int = 2) -> tuple[list[FakeSession], list[Segment], Frame, Frame]:
    """Hops a and b, a frame of ``tokens`` at position 10 (all 1.0) and a second (all 2.0) sent ahead of it."""
    sessions, segments = hops("a", "b")
    first = Frame(chain, segments, hidden(tokens, 1.0), 10)
    return sessions, segments, first, Frame(chain, segments, hidden(tokens, 2.0), 10 + tokens, before=first, ahead=True)


async def test_frames_reach_each_hop_in_order_and_histories_stay_in_position_order() -> None:
    chain = FakeChain()
    (a, b), segments, first, second = two_frames(chain, tokens=3)
    await settled()
    assert a.sent == [10, 13] and b.sent == []  # the second left before the first returned
    a.answer(1, hidden(3, 20.0))  # handled first: its record still waits for the first's
    await settled()
    assert segments[0].history == []
    a.answer(0, hidden(3, 10.0))
    await settled()
    assert [position for position, _ in segments[0].history] == [10, 13]
    assert b.sent == [10, 13]  # the first went on to b before the second did
    b.answer(0, hidden(3, 11.0))
    b.answer(1, hidden(3, 21.0))
    out_first, out_second = await first.output(), await second.output()
    assert out_first is not None and out_second is not None
    assert torch.equal(out_second, hidden(3, 21.0))
    assert [position for position, _ in segments[1].history] == [10, 13]
    assert sorted(chain.receipts, key=str) == sorted(  # each spot check sees its own step's receipt
        [("a", 10, ("receipt", 10.0)), ("a", 13, ("receipt", 20.0)), ("b", 10, ("receipt", 11.0))]
        + [("b", 13, ("receipt", 21.0))],
        key=str,
    )
    assert torch.equal(segments[1].history[1][1], hidden(3, 20.0))  # b's input: a's output of the second frame


async def test_a_frame_ahead_of_a_failed_one_is_void_and_records_nothing() -> None:
    (a, b), segments, first, second = two_frames(FakeChain())
    await settled()
    a.answer(1, hidden(2, 20.0))
    a.answer(0, NodeUnreachable("gone"))
    assert await first.output() is None and await second.output() is None
    assert first.voided and second.voided
    assert segments[0].history == [] and b.sent == []


async def test_a_frame_not_ahead_goes_on_after_a_void_one() -> None:
    (a, b), segments = hops("a", "b")
    chain = FakeChain()
    wrong = Frame(chain, segments, hidden(2, 1.0), 10)
    await settled()
    wrong.void()  # a rejected draft made it wrong while a computed it
    again = Frame(chain, segments, hidden(1, 3.0), 10, before=wrong)
    await settled()
    assert a.sent == [10, 10]
    a.answer(0, hidden(2, 10.0))
    assert await wrong.output() is None
    await settled()
    assert b.sent == []  # the void frame went no further
    a.answer(1, hidden(1, 30.0))
    await settled()
    assert b.sent == [10]
    b.answer(0, hidden(1, 31.0))
    output = await again.output()
    assert output is not None and torch.equal(output, hidden(1, 31.0))
    assert [(p, h.shape[1]) for p, h in segments[0].history] == [(10, 1)]  # it rewrote what the void one wrote


async def test_void_stops_a_frame_before_its_next_hop() -> None:
    (a, b), segments = hops("a", "b")
    frame = Frame(FakeChain(), segments, hidden(2, 1.0), 10)
    await settled()
    frame.void()
    a.answer(0, hidden(2, 10.0))
    assert await frame.output() is None
    assert b.sent == [] and [p for p, _ in segments[0].history] == [10]  # a ran it: its history says so


@pytest.mark.parametrize("cause", ["error", "distrusted"])
async def test_a_frame_meeting_an_error_is_void_and_never_raises(cause: str) -> None:
    (a, b), segments = hops("a", "b")
    chain = FakeChain(distrusted={"b"} if cause == "distrusted" else set())
    frame = Frame(chain, segments, hidden(2, 1.0), 10)
    await settled()
    a.answer(0, hidden(2, 10.0))
    await settled()
    if cause == "error":
        b.answer(0, NodeUnreachable("gone"))
    assert await frame.output() is None and frame.voided
    assert [p for p, _ in segments[1].history] == []


async def test_a_frame_ahead_goes_no_further_once_the_frame_before_it_is_voided() -> None:
    (a, b), segments, first, second = two_frames(FakeChain())
    await settled()
    a.answer(0, hidden(2, 10.0))
    await settled()
    assert b.sent == [10]
    first.void()  # a rejected draft: the first's own answer still comes, the second's guess is wrong
    a.answer(1, hidden(2, 20.0))
    b.answer(0, hidden(2, 11.0))
    assert await second.output() is None and second.voided
    assert b.sent == [10]
    assert [p for p, _ in segments[0].history] == [10]  # answered after the void: left out (a rewind follows)


async def test_a_frame_ahead_of_one_voided_before_it_left_sends_nothing() -> None:
    chain = FakeChain()
    (a, _), segments, first, second = two_frames(chain)
    second.void()
    third = Frame(chain, segments, hidden(2, 3.0), 14, before=second, ahead=True)
    await settled()
    assert a.sent == [10]
    a.answer(0, hidden(2, 10.0))
    assert await second.output() is None and await third.output() is None and third.voided


class FakeRouter:
    rtts: dict[str, float] = {}
    verifier = None

    def __init__(self) -> None:
        self.stats = SimpleNamespace(relayed_hops=0)

    def trusted(self, peer: str) -> bool:
        return True

    def record_success(self, peer: str) -> None:
        pass


async def test_an_ordinary_step_waits_until_the_frames_in_flight_stop() -> None:
    """``ChainSession.step`` voids the frames and waits for them: it never reaches a node beside them (nor fails
    over a hop whose stream a frame is reading)."""
    (a, b), segments = hops("a", "b")
    chain = ChainSession(cast(Any, None), cast(Any, FakeRouter()), 64, 5.0)
    chain._segments, chain._steps = segments, 1
    first = chain.frame(hidden(2, 1.0), 10)
    ahead = chain.frame(hidden(2, 2.0), 12, ahead=True)
    await settled()
    stepping = asyncio.create_task(chain.step(hidden(1, 3.0), 10))
    await settled()
    assert a.stepped == [] and first.voided and ahead.voided
    a.answer(0, hidden(2, 10.0))
    await settled()
    assert a.stepped == []  # the frame ahead still waits for a's answer
    a.answer(1, hidden(2, 20.0))
    output = await stepping
    assert torch.equal(output, hidden(1, 5.0)) and a.stepped == [10] and b.stepped == [10]
    assert b.sent == []  # the void frames went no further than a
    assert [(p, h.shape[1]) for p, h in segments[0].history] == [(10, 1)]  # the step rewrote what they wrote
