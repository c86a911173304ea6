"""A session's latest decode step, taken from whichever of its inputs arrives first: a push or the gateway.

With node-to-node push the same step can reach a node twice: pushed by its predecessor, and relayed by the gateway
(which falls back to relaying when a push is late or refused). The first arrival runs the step; a later arrival of
the same input at the same position gets that run's output, never a second run. A different input at the position
(a replacement predecessor's) is a new step that rewinds the session there, as a gateway step always could; it runs
after the step it replaces, never beside it (both write the same KV positions). A push that arrives late, at or
behind the latest step's position (the gateway relayed that step and went on), is refused. A push past the latest
step's position but within what the session holds is the next verify step after rejected drafts: the latest step
wrote several positions and the gateway rewinds over the rejected ones (as its own step would).

The gateway's "answer me when it has run" request (a pushed row) waits here for the step at its position.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from shared.errors import PushMissing, PushRefused, UnknownSession

# Runs the step: (hidden [1, T, D], position) -> output [1, T, D].
RunStep = Callable[[torch.Tensor, int], Awaitable[torch.Tensor]]


@dataclass
class Slot:
    position: int
    hidden: torch.Tensor  # [1, T, D] the input that ran
    output: asyncio.Task[torch.Tensor]


class StepSlots:
    """The latest step of one session (older ones are answered already: the gateway steps a session in order)."""

    def __init__(self) -> None:
        self.slot: Slot | None = None
        self._changed = asyncio.Event()
        self._ended = False

    def offer(
        self, hidden: torch.Tensor, position: int, run: RunStep, pushed_at: int | None = None
    ) -> tuple[Slot, bool]:
        """The slot that runs ``hidden`` at ``position``, and whether this offer started it (False: it ran already,
        or is running, for the same input). ``pushed_at``: a push, to a session that holds that many tokens."""
        slot = self.slot
        if slot is not None and slot.position == position and torch.equal(slot.hidden, hidden):
            return slot, False
        # Steps come in order: the latest step's position bounds a push (without one, what the session holds does).
        if pushed_at is not None and (position <= slot.position if slot is not None else position < pushed_at):
            raise PushRefused(f"a push for position {position} is behind the session ({pushed_at} tokens held)")
        before = slot.output if slot is not None else None
        slot = Slot(position, hidden, asyncio.ensure_future(_after(before, run(hidden, position))))
        self.slot = slot
        self._changed.set()
        self._changed = asyncio.Event()
        return slot, True

    async def wait(self, position: int, within: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of the step at ``position`` once it has run; ``PushMissing`` if no input came in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while (slot := self.slot) is None or slot.position != position:
            if self._ended:
                raise UnknownSession("the session ended while waiting for a pushed step")
            changed = self._changed
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0)):
                    await changed.wait()
            except TimeoutError:
                raise PushMissing(f"no input for position {position} arrived within {within:.1f}s") from None
        return slot.hidden, await asyncio.shield(slot.output)

    def clear(self) -> None:
        """An inference-stream step rewrote the session: its latest decode step is no longer the latest."""
        self.slot = None

    def end(self) -> None:
        """The session ended: waiters stop waiting."""
        self._ended = True
        self._changed.set()


async def _after(before: asyncio.Task[torch.Tensor] | None, step: Awaitable[torch.Tensor]) -> torch.Tensor:
    """Run ``step`` once the step it replaces has finished (however it ended)."""
    if before is not None and not before.done():
        await asyncio.wait([before])
    return await step
