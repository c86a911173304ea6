"""Starting and stopping hivemind's DHT so that it never outlives, nor holds up, the process that started it.

hivemind runs the DHT in a child process (with its own p2pd daemon). If the parent is SIGKILLed or crashes, that
child would linger forever, still a member of the swarm. A watchdog coroutine inside the child polls its parent
and, once the parent is gone, shuts the DHT node down (which stops p2pd) and exits.

The other way round, a child that does not stop must not keep its parent alive: ``stop_dht`` asks it to leave, and
kills it and its p2pd when it does not within a grace period (see there for why hivemind's own shutdown can hang).
And a child (or its p2pd) that dies while the parent runs must not leave the parent running unseen: ``until_dht_lost``
raises ``DhtLost`` then.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import weakref
from collections.abc import Awaitable, Iterator, Mapping
from functools import partial
from typing import Any, TypeVar

import psutil
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from shared.background import stop_task
from shared.errors import DhtLost
from shared.identity import PeerIdentity, register_identity
from shared.unary_calls import guard_unary_calls

logger = logging.getLogger(__name__)

T = TypeVar("T")

PARENT_POLL_SECONDS = 1.0
STOP_GRACE_SECONDS = 3.0  # a healthy DHT child leaves in well under a second; a stuck one is killed after this
KILL_WAIT_SECONDS = 5.0  # SIGKILL is final: this only covers the kernel reaping the process on a loaded machine

# Every DHT ``start_dht`` started and nobody stopped yet, for the exit hook below.
_running: weakref.WeakSet[DHT] = weakref.WeakSet()
# Each DHT's replica of its P2P once ``replicate_p2p`` has made it: asked again, it is handed back without a call
# into the child (which, dead by then, would never answer).
_replicas: weakref.WeakKeyDictionary[DHT, P2P] = weakref.WeakKeyDictionary()


def start_dht(
    *, identity: PeerIdentity | None = None, daemon_flags: Mapping[str, Any] | None = None, **kwargs: Any
) -> DHT:
    """``identity``: the key p2pd takes as the peer's identity, the same that signs its records (``dht_kwargs``).

    ``daemon_flags``: p2pd command-line flags hivemind's ``P2P.create`` has no parameter for (the relay service's
    limits: ``relayService``, ``relayMaxCircuits``, ...).
    """
    guard_unary_calls()  # before any P2P exists: the DHT child (forked) and every replica of its P2P get the guard
    with _extra_daemon_flags(daemon_flags or {}):
        if identity is None:
            dht = DHT(start=True, **kwargs)
        else:
            # A key generated just now is nobody else's: skip hivemind's probe of the swarm for a peer using it.
            probe = {} if identity.path else {"check_if_identity_free": False}
            with identity.key_file() as path:  # p2pd has read it once the DHT is up; a temporary file goes then
                dht = DHT(start=True, identity_path=path, **probe, **kwargs)
    if identity is not None:
        if dht.peer_id.to_base58() != identity.peer_id:
            stop_dht(dht)
            raise RuntimeError(f"p2pd took the peer id {dht.peer_id}, not {identity.peer_id} of its identity key")
        register_identity(identity)
    dht.run_coroutine(partial(_exit_with_parent, parent=os.getpid()), return_future=True)
    _running.add(dht)
    return dht


def stop_dht(dht: DHT, grace: float = STOP_GRACE_SECONDS) -> None:
    """Stop ``dht``'s child process and its p2pd: returns within ``grace`` + a few seconds, whatever state they are in.

    hivemind's ``DHT.shutdown`` asks the child to leave, waits, then ``terminate()``s it: a SIGTERM that a child
    forked by one of our processes never acts on, because it inherits the parent's asyncio signal handler (which
    only writes to a wakeup fd nobody reads in the child). A child whose shutdown hangs — its p2pd stuck, or
    closing connections to peers that vanished — then survives, and multiprocessing's exit hook joins it without a
    timeout: the parent never exits. So after the grace period the child is SIGKILLed, and with it the p2pd it
    started (found now: once the child is dead its daemon is nobody's child any more).
    """
    _running.discard(dht)
    if dht.pid is None:
        return  # never started
    daemons = _descendants(dht.pid)
    dht.shutdown_timeout = grace
    with contextlib.suppress(OSError):  # its pipe already closed by an earlier stop
        dht.shutdown()
    if dht.is_alive():
        logger.warning("DHT process %d did not stop within %.0fs; killing it and its p2pd", dht.pid, grace)
        dht.kill()
        dht.join(KILL_WAIT_SECONDS)
    _kill(daemons)


@atexit.register
def _stop_leftovers() -> None:
    # Registered after multiprocessing's own exit hook (hivemind imports it first), so it runs before that hook
    # joins the children: whatever DHT was not stopped on the way out is stopped here, within the same bounds.
    for dht in list(_running):
        stop_dht(dht)


async def replicate_p2p(dht: DHT) -> P2P:
    """``dht.replicate_p2p()``, that a dead DHT child cannot stop the whole process in.

    hivemind's asks the child for its p2pd's address with a blocking call on the event loop: with the child dead,
    that call never returns and nothing else in the process runs, ``until_dht_lost`` included. So the child is first
    asked through an awaited future (the same pipe): a dead child is seen while that waits, and after its answer
    the blocking call is answered at once. Once made, the replica is handed back without asking again.
    """
    if dht in _replicas:
        return _replicas[dht]
    await dht.run_coroutine(_answer, return_future=True)
    p2p = _replicas[dht] = await dht.replicate_p2p()
    return p2p


async def _answer(_dht: DHT, _node: DHTNode) -> None:
    """Run in the DHT child: an answer is all that is asked."""


async def visible_maddrs(dht: DHT) -> list[Multiaddr]:
    """``dht.get_visible_maddrs()`` awaited, not blocking a thread: on a dead child that thread would wait forever,
    and ``asyncio.run`` waits for it on the way out."""
    return await dht.run_coroutine(_visible_maddrs, return_future=True)


async def _visible_maddrs(_dht: DHT, node: DHTNode) -> list[Multiaddr]:
    return await node.get_visible_maddrs()


async def until_dht_lost(dht: DHT, work: Awaitable[T]) -> T:
    """``work``'s result; or, should ``dht``'s child process or its p2pd exit first, ``work`` cancelled and
    ``DhtLost`` raised.

    Nothing else would tell: a call into a dead child's pipe waits forever (hivemind resolves its futures from the
    child), and a node whose DHT died would go on answering the sessions it has, unannounced, its records expiring,
    every health check green. Polled: no event announces the exit of a grandchild (p2pd).
    """
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_lost(dht))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost = watch.done()
        await stop_task(watch)
        await stop_task(work_task)  # a no-op once it is done
    if lost:
        raise DhtLost(watch.result())
    return work_task.result()


async def _lost(dht: DHT) -> str:
    daemons = _descendants(dht.pid) if dht.pid is not None else []
    while dht in _running:  # one stopped on purpose is not lost
        if not dht.is_alive():
            return f"the DHT process {dht.pid} exited (code {dht.exitcode})"
        for daemon in daemons:
            if not _running_process(daemon):
                return f"the DHT process's p2pd {daemon.pid} exited"
        await asyncio.sleep(PARENT_POLL_SECONDS)
    await asyncio.Future()  # never: nothing to report
    raise AssertionError("unreachable")


def _running_process(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return list(psutil.Process(pid).children(recursive=True))
    return []


def _kill(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()  # psutil refuses to signal a pid that has since been reused by another process
    psutil.wait_procs(processes, timeout=KILL_WAIT_SECONDS)


async def _exit_with_parent(dht: DHT, node: DHTNode, *, parent: int) -> None:
    while os.getppid() == parent:  # noqa: ASYNC110 - no event announces a parent's death; polling is the way
        await asyncio.sleep(PARENT_POLL_SECONDS)
    daemons = _descendants(os.getpid())
    try:
        async with asyncio.timeout(5):
            await node.shutdown()
    finally:
        _kill(daemons)  # a p2pd that did not stop with the node would otherwise run on alone
        os._exit(0)


@contextlib.contextmanager
def _extra_daemon_flags(flags: Mapping[str, Any]) -> Iterator[None]:
    """While a DHT starts, p2pd is launched with ``flags`` too.

    hivemind builds p2pd's command line in ``P2P._make_process_args`` and exposes no way to add to it; the DHT's
    child process is forked inside ``DHT(start=True)``, so it inherits the wrapper installed here, and the parent
    restores hivemind's own right after.
    """
    if not flags:
        yield
        return
    original = P2P._make_process_args

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        made: list[str] = original(*args, **{**kwargs, **flags})
        return made

    P2P._make_process_args = staticmethod(with_flags)
    try:
        yield
    finally:
        P2P._make_process_args = staticmethod(original)
