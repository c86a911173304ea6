"""One table from an error's code to what the swarm client does about it; the failover code reads nothing else.

    code                    recovery   what happens to the node            and to the session
    node_unreachable        GONE       out of routing until it announces   its range is routed again and replayed;
    (dead, frozen)                     again (a newer record); no ban      with no one left, it waits for a node
    step_timeout            FAULT      banned (capped, see bans.py)        routed again and replayed
    malformed_reply         FAULT      banned
    bad_receipt             FAULT      banned, and its trust cut as if
                                       outvoted (gateway.swarm.verify)
    internal_error          FAULT      banned
    cache_full              BUSY       skipped now, never banned           another node, or it waits on this one
                                                                           for room (up to --failover-wait), then
                                                                           the error: a capacity answer (HTTP 429);
                                                                           a new chain holds no other node while
                                                                           it waits (failover.reopen), one mid-
                                                                           stream lets go of them once this one
                                                                           refused after a wait (ChainReopened)
    node_draining           STALE      out of routing until it announces   routed again and replayed
    wrong_span              STALE        again (its record is out of date)
    protocol_mismatch       STALE
    node_distrusted         MOVE       kept out of routing by the verifier  routed again and replayed
                                       (gateway.swarm.verify), no ban
    missing_blocks          WAIT       -                                   waits up to --failover-wait for a node
                                                                           to join or come back, then the error
    anything else           FAIL       -                                   the error reaches the caller (bad
    (bad_request, unknown_session, position_out_of_range, unauthorized,    request, our bug or our config: no
    unknown codes of newer nodes)                                          other node would answer differently)

Only faults ban: capacity and state are what a healthy node says about itself. A gone node is not banned either:
hiding it until it announces again keeps every session off it (one death seen by 32 sessions is one event, not 32
failures), and a node that announces again has restarted or thawed, and deserves its sessions.
"""

from __future__ import annotations

from enum import StrEnum

from shared.errors import (
    BadReceipt,
    CacheFull,
    MalformedReply,
    MissingBlocks,
    NodeDistrusted,
    NodeDraining,
    NodeInternalError,
    NodeUnreachable,
    ProtocolMismatch,
    StepTimeout,
    SwarmError,
    WrongSpan,
)

# Seconds a failover waits for a lost range to be served again, or for room on a full node (``--failover-wait``'s
# default; the simulator's sessions wait as long).
DEFAULT_FAILOVER_WAIT = 120.0
WAIT_POLL = 1.0  # seconds between looks at the swarm while waiting for a node to serve a lost range
ROOM_WAIT = 10.0  # seconds a full node is asked to hold an open until it has room (then the chain asks again)


class Recovery(StrEnum):
    GONE = "gone"
    FAULT = "fault"
    BUSY = "busy"
    STALE = "stale"
    WAIT = "wait"
    FAIL = "fail"
    MOVE = "move"

    @property
    def bans(self) -> bool:
        return self is Recovery.FAULT

    @property
    def until_announced(self) -> bool:
        """Whether the node stays out of routing until it announces again."""
        return self in (Recovery.GONE, Recovery.STALE)


RECOVERY: dict[str, Recovery] = {
    NodeUnreachable.code: Recovery.GONE,
    StepTimeout.code: Recovery.FAULT,
    MalformedReply.code: Recovery.FAULT,
    BadReceipt.code: Recovery.FAULT,
    NodeInternalError.code: Recovery.FAULT,
    CacheFull.code: Recovery.BUSY,
    NodeDraining.code: Recovery.STALE,
    WrongSpan.code: Recovery.STALE,
    ProtocolMismatch.code: Recovery.STALE,
    MissingBlocks.code: Recovery.WAIT,
    NodeDistrusted.code: Recovery.MOVE,
}


def recovery_for(error: BaseException) -> Recovery:
    """What to do about ``error``; anything that is not a known swarm error fails."""
    if isinstance(error, SwarmError):
        return RECOVERY.get(error.code, Recovery.FAIL)
    return Recovery.FAIL
