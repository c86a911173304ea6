"""hivemind's unary calls made safe to cancel: a call cancelled in the turn its reply arrives must not stop every
later one.

hivemind's ``ControlClient`` (``hivemind.p2p.p2p_daemon_bindings.control``, 1.1.12) reads every unary reply, and
every unary request to this peer, in one task over its persistent connection to p2pd. It checks that a call still
waits with ``call_id in self._pending_calls`` and then sets that call's future. A caller cancelled in the same turn
as its reply (a timeout firing just as the node answers) has a cancelled future there until its ``finally`` pops
it: ``set_result`` raises ``InvalidStateError``, the reader task ends, and from then on no unary call of that P2P
is answered and no unary request to it is handled — a gateway stops probing and checking nodes, a node stops
answering forwards and info, all silently. The guard makes the table say a finished future is not waiting, so the
reader drops a reply nobody waits for. Written by hand: no hivemind release fixes it, and the table is private,
so its shape is checked at start and an unknown shape refuses to start rather than be guessed at.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

_GUARDED = "_swarmgate_unary_guard"


class WaitingCalls(dict[Any, "asyncio.Future[bytes]"]):
    """hivemind's table of unary calls in flight, where a call whose future is done (cancelled) no longer waits."""

    def __contains__(self, call_id: object) -> bool:
        future = self.get(call_id)
        return future is not None and not future.done()


class UnsupportedHivemind(RuntimeError):
    """hivemind's control client is not the one ``guard_unary_calls`` knows: refused rather than guessed at."""


def guard_unary_calls() -> None:
    """Install the guard on every ``ControlClient`` made from now on in this process and in children it forks (the
    DHT's). Idempotent; raises ``UnsupportedHivemind`` when the client's table is not where 1.1.x keeps it."""
    init = ControlClient.__init__
    if getattr(init, _GUARDED, False):
        return
    if not hasattr(ControlClient, "_read_from_persistent_conn"):
        raise UnsupportedHivemind("hivemind's ControlClient reads unary replies some other way than 1.1.x does")

    @functools.wraps(init)
    def guarded_init(self: ControlClient, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        calls = getattr(self, "_pending_calls", None)
        if type(calls) is not dict:
            raise UnsupportedHivemind(f"hivemind's ControlClient keeps its unary calls in {type(calls).__name__}")
        self._pending_calls = WaitingCalls(calls)

    setattr(guarded_init, _GUARDED, True)
    ControlClient.__init__ = guarded_init
