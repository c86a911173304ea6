"""``over_transport`` never drops its caller's cancel: on Python 3.11 ``asyncio.wait_for`` returned the result of work
that completed in the same turn as the cancel, and a generation stopped that way decoded on to its end."""

from __future__ import annotations

import asyncio

import pytest

from shared.errors import StepTimeout
from shared.rpc_client import over_transport


async def test_a_cancel_that_comes_with_the_reply_still_cancels() -> None:
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    call = asyncio.create_task(over_transport("peer", "answer", reply, 10.0))
    await asyncio.sleep(0)  # the call waits on the reply
    await asyncio.sleep(0)
    reply.set_result(1)
    call.cancel()  # in the same turn as the reply
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_work_past_its_limit_is_a_step_timeout() -> None:
    with pytest.raises(StepTimeout, match="did not answer within 0.01s"):
        await over_transport("peer", "answer", asyncio.Event().wait(), 0.01)
