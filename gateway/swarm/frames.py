"""Pipelined verify frames: a chain's next verify step sent before the previous one has come back.

A frame goes hop by hop on each node session's own stream (``NodeSession.send_step``), relayed by the gateway like
any step. A node serves a stream one message at a time, so two frames sent to a hop in order run there in order:
the later one finds the session holding its position. Here the gateway keeps the order on its side too:

- a frame is sent to a hop only after the frame before it was (or never will be): ``_sent``; a frame sent *ahead*
  (drafted on the guess that the frame before it is kept whole) is void when that one is;
- its input is recorded in the hop's failover history only after the frame before it recorded (or never will):
  histories stay in position order (``_recorded``);
- a frame never fails over. Any error (a node gone, a refusal, a distrusted node) voids it, and so does the
  generation when a rejected draft makes it wrong (``void``); a voided frame sends nothing more, and every frame
  after it is void too. The generation then sends the step again as an ordinary one (``ChainSession.step``), which
  waits for the frames to stop, rewinds every hop by position and fails over as always: a replacement is replayed
  the history, in which frame n precedes frame n + 1.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import torch

from gateway.swarm.router import Router
from gateway.swarm.segment import Segment
from shared.receipts import Receipt

logger = logging.getLogger(__name__)


class FrameChain(Protocol):
    """What a frame needs of its chain (``ChainSession``)."""

    @property
    def router(self) -> Router: ...

    def check_trusted(self, segment: Segment) -> None: ...

    def observed(self, segment: Segment, output: torch.Tensor, receipt: Receipt | None = None) -> None: ...


class Frame:
    """One verify step in flight: hidden [1, T, D] at ``position``, through ``segments`` in order, after ``before``
    (the frame sent just before it, if still running); ``ahead``: it is of use only if ``before`` is."""

    def __init__(
        self,
        chain: FrameChain,
        segments: list[Segment],
        hidden: torch.Tensor,
        position: int,
        before: Frame | None = None,
        ahead: bool = False,
    ) -> None:
        self.position = position
        self.end = position + hidden.shape[1]
        self._chain = chain
        self._segments = segments
        self._before = before
        self._ahead = ahead
        self._sent = [asyncio.Event() for _ in segments]  # hop i: this frame sent there, or never will
        self._recorded = [asyncio.Event() for _ in segments]  # hop i: recorded there, or never will
        self.voided = False
        self._task = asyncio.create_task(self._run(hidden))

    def void(self) -> None:
        """The frame is of no use (a draft before it was rejected): it sends nothing more."""
        self.voided = True

    async def output(self) -> torch.Tensor | None:
        """The last block's output [1, T, D]; None when the frame was voided or failed."""
        return await asyncio.shield(self._task)

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def stopped(self) -> None:
        """Wait until the frame touches no node any more (it may have been cancelled: then it stopped too)."""
        await asyncio.wait([self._task])

    def cancel(self) -> None:
        self._task.cancel()

    async def _run(self, hidden: torch.Tensor) -> torch.Tensor | None:
        try:
            for index, segment in enumerate(self._segments):
                if not await self._may_send(index):
                    return None
                self._chain.check_trusted(segment)
                reply = segment.session.send_step(hidden, self.position)
                self._sent[index].set()
                output = await reply
                receipt = segment.session.last_receipt  # this step's: a later frame's answer may replace it below
                if not await self._may_record(index):
                    return None
                segment.record(self.position, hidden)
                self._chain.observed(segment, output, receipt)
                self._chain.router.record_success(segment.session.hop.peer_id)
                self._chain.router.stats.relayed_hops += hidden.shape[1] == 1  # counted as ``ChainSession.relay`` does
                self._recorded[index].set()
                hidden = output
            return hidden
        except Exception as error:  # the ordinary step that replaces the frame fails over; this only gives up
            logger.info("a pipelined frame at %d gave up (%s): its step goes again unpipelined", self.position, error)
            self.voided = True
            return None
        finally:
            for event in [*self._sent, *self._recorded]:
                event.set()
            self._before = None  # frames hold only the running ones before them, never a generation's history

    async def _may_send(self, index: int) -> bool:
        """Whether the frame goes on to hop ``index``: after the frame before it went there, and not void."""
        before = self._before
        if before is not None:
            await before._sent[index].wait()
            if self._ahead and before.voided:
                self.voided = True
        return not self.voided

    async def _may_record(self, index: int) -> bool:
        """Whether the hop's answer joins its history: after the frame before it recorded there. A frame ahead of
        one that failed is not recorded (its input would follow a gap); the step sent in its place rewinds the node
        below it. A frame not ahead rewinds over a void one (its position is at most the void one's)."""
        before = self._before
        if before is not None:
            await before._recorded[index].wait()
            if self._ahead and before.voided:
                self.voided = True
                return False
        return True
