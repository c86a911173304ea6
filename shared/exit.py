"""Leaving a long-lived process quickly once its work is done and its cleanup has run."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

# What the loop's log message for the false alarm below starts with: the repr of the stream protocol's done callback.
_STREAM_HANDLER_CALLBACK = "Exception in callback StreamReaderProtocol.connection_made.<locals>.callback"


def skip_final_collection() -> None:
    """Exempt every live object from the garbage collections the interpreter runs while it shuts down.

    A node or gateway holds torch's, transformers' and hivemind's module graphs (millions of objects); collecting
    them on the way out took 2.5 s on an idle 2-core machine and over 8 s under load, after the process had already
    stopped serving and released everything that matters (its DHT child, p2pd, sockets). The memory goes back to the
    system when the process exits either way; atexit hooks still run, and so does whatever reference counting frees;
    only cycles are left for the operating system to reclaim.
    """
    gc.freeze()


def drop_cancelled_stream_handler_alarms(loop: asyncio.AbstractEventLoop) -> None:
    """Keep one false alarm out of the loop's error log; everything else goes where it went before.

    Python 3.11.7's ``asyncio.StreamReaderProtocol`` calls ``task.exception()`` in the done callback of a stream
    server's connection task; on a cancelled task that raises ``CancelledError``, which the loop logs as an ERROR
    with a traceback. hivemind serves each incoming p2p stream (a node's sessions, a gateway's pushed results) as
    such a task, and ``asyncio.run`` cancels the ones still open when a process stops: nothing failed, but every
    stop with a session open printed tracebacks. Only that case, a cancellation reported from that callback, is
    dropped.
    """
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        cancelled = isinstance(context.get("exception"), asyncio.CancelledError)
        if cancelled and str(context.get("message", "")).startswith(_STREAM_HANDLER_CALLBACK):
            return
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)

    loop.set_exception_handler(handle)
