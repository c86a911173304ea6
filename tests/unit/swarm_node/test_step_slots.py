"""A session's latest decode step runs once, whichever of push and gateway brings it first (pure asyncio)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.errors import PushMissing, PushRefused, UnknownSession
from swarm_node.step_slots import StepSlots


class Runner:
    def __init__(self) -> None:
        self.runs = 0
        self.running = 0
        self.most_at_once = 0  # steps of the session running together (they would write the same KV positions)

    async def __call__(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        self.runs += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        return hidden * 2 + position


async def test_the_same_input_at_the_same_position_runs_once_and_a_different_one_runs_again() -> None:
    slots, run = StepSlots(), Runner()
    hidden = torch.ones(1, 1, 4)
    first, fresh = slots.offer(hidden, 3, run)
    again, fresh_again = slots.offer(hidden.clone(), 3, run)
    assert fresh and not fresh_again and again is first
    assert torch.equal(await first.output, await again.output) and run.runs == 1
    other, fresh_other = slots.offer(hidden * 5, 3, run)  # a replacement predecessor's output: rewinds, runs
    assert fresh_other and torch.equal(await other.output, hidden * 10 + 3) and run.runs == 2
    _, next_fresh = slots.offer(hidden, 4, run)
    assert next_fresh


async def test_a_waiter_gets_the_input_and_output_of_its_position_whenever_the_step_arrives() -> None:
    slots, run = StepSlots(), Runner()
    waiting = asyncio.ensure_future(slots.wait(7, 5.0))
    await asyncio.sleep(0)
    slots.offer(torch.ones(1, 1, 4), 6, run)  # an older position does not answer it
    await asyncio.sleep(0)
    assert not waiting.done()
    slots.offer(torch.full((1, 1, 4), 2.0), 7, run)
    received, output = await waiting
    assert torch.equal(received, torch.full((1, 1, 4), 2.0)) and torch.equal(output, torch.full((1, 1, 4), 11.0))
    assert torch.equal((await slots.wait(7, 0.0))[1], output)  # already there: no wait


async def test_a_push_that_never_comes_is_push_missing_and_an_ended_session_stops_waiters() -> None:
    slots = StepSlots()
    with pytest.raises(PushMissing):
        await slots.wait(1, 0.05)
    waiting = asyncio.ensure_future(slots.wait(1, 5.0))
    await asyncio.sleep(0)
    slots.end()
    with pytest.raises(UnknownSession):
        await waiting


async def test_a_push_never_rewinds_and_a_rewind_runs_after_the_step_it_replaces() -> None:
    slots, run = StepSlots(), Runner()
    hidden = torch.ones(1, 1, 4)
    first, _ = slots.offer(hidden, 5, run, pushed_at=5)
    again, fresh = slots.offer(hidden.clone(), 5, run, pushed_at=5)  # the same step pushed and relayed: one run
    assert again is first and not fresh
    with pytest.raises(PushRefused):  # late, with another input: only the gateway may rewind
        slots.offer(hidden * 3, 5, run, pushed_at=5)
    with pytest.raises(PushRefused):  # behind what the session holds
        slots.offer(hidden, 4, run, pushed_at=6)
    rewind, _ = slots.offer(hidden * 3, 5, run)  # the gateway's rewind waits for the step it replaces
    assert not first.output.done()
    await rewind.output
    assert first.output.done() and run.runs == 2 and run.most_at_once == 1


async def test_a_push_may_rewind_over_the_latest_steps_own_positions_only() -> None:
    """A verify step of four positions at 5 (the session then holds 9), two drafts rejected: the next verify step,
    pushed at 7, runs; a push at or behind 5 is late; without a latest step, nothing below what is held is pushed."""
    slots, run = StepSlots(), Runner()
    verify, _ = slots.offer(torch.ones(1, 4, 4), 5, run, pushed_at=5)
    await verify.output
    with pytest.raises(PushRefused):
        slots.offer(torch.ones(1, 3, 4) * 2, 5, run, pushed_at=9)
    following, fresh = slots.offer(torch.ones(1, 3, 4) * 2, 7, run, pushed_at=9)
    assert fresh and torch.equal(await following.output, torch.ones(1, 3, 4) * 4 + 7)
    slots.clear()  # a truncate or an inference-stream step: the latest step is no longer known
    with pytest.raises(PushRefused):
        slots.offer(torch.ones(1, 2, 4), 8, run, pushed_at=10)
