"""Replies of a request stream in request order, each request served as soon as it arrives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from hivemind.proto import runtime_pb2


async def in_order(
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    answer: Callable[[runtime_pb2.ExpertRequest], Coroutine[Any, Any, runtime_pb2.ExpertResponse]],
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """Serve each request as soon as it arrives (a later one need not wait for an earlier one's forward: its rows
    may join the batch that is forming), and reply in request order, which is how the client pairs them."""
    answers: asyncio.Queue[asyncio.Task[runtime_pb2.ExpertResponse] | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async for request in requests:
                answers.put_nowait(asyncio.create_task(answer(request)))
        finally:
            answers.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (task := await answers.get()) is not None:
            yield await task
    finally:
        reader.cancel()
        while not answers.empty():
            if (pending := answers.get_nowait()) is not None:
                pending.cancel()
