"""Typed errors shared by the node and the gateway.

Every error that can cross the wire has a stable string ``code`` and a ``retryable`` flag; the node sends the code,
the client rebuilds the same exception type from it (``error_from_code``), and only retryable ones are retried.

    SwarmError
    ├── RemoteError                 (crosses the wire)
    │   ├── ProtocolMismatch        not retryable: client and node speak different protocol versions
    │   ├── BadRequest              not retryable: malformed message, wrong hidden size / dtype / shape
    │   ├── UnknownSession          not retryable: step for a session the node does not hold
    │   ├── PositionOutOfRange      not retryable: positions beyond the session's max length
    │   ├── WrongSpan               not retryable: blocks asked for are not served by this node
    │   ├── Unauthorized            not retryable: no valid call token for this private swarm
    │   ├── PushRefused             not retryable: a push from a peer the session's opener did not name
    │   ├── PushMissing             retryable: a pushed step's input never came (the gateway relays it instead)
    │   ├── CacheFull               retryable: the node's KV-cache pool has no room now
    │   ├── NodeDraining            retryable: the node accepts no new sessions
    │   └── NodeInternalError       retryable: anything unexpected on the node
    ├── MissingBlocks               no live node covers some blocks
    ├── NodeUnreachable             the connection to a node failed or closed, or it answers no ping (dead, frozen)
    ├── MalformedReply              a node answered something that is no valid reply (wrong shape, NaN, garbage)
    ├── BadReceipt                  a step reply's receipt is missing, or not signed by the node routed to
    ├── StepTimeout                 a remote step took longer than allowed while the node still answered pings
    ├── NodeDistrusted              the gateway's checks took the node out of routing (gateway.swarm.verify)
    ├── ModelLoadError              a model could not be resolved or loaded
    │   └── CacheApiMismatch        the installed transformers' decoder layers take no cache keyword we know
    └── DhtLost                     this process's DHT child or its p2pd exited without being stopped
"""

from __future__ import annotations

from typing import ClassVar


class SwarmError(Exception):
    """Base of every error raised by swarmgate's own code."""

    code: ClassVar[str] = "swarm_error"
    retryable: ClassVar[bool] = False


class RemoteError(SwarmError):
    """An error a node reports over the wire."""

    code = "remote_error"


class ProtocolMismatch(RemoteError):
    code = "protocol_mismatch"


class BadRequest(RemoteError):
    code = "bad_request"


class UnknownSession(RemoteError):
    code = "unknown_session"


class PositionOutOfRange(RemoteError):
    code = "position_out_of_range"


class WrongSpan(RemoteError):
    code = "wrong_span"


class Unauthorized(RemoteError):
    code = "unauthorized"


class PushRefused(RemoteError):
    code = "push_refused"


class PushMissing(RemoteError):
    code = "push_missing"
    retryable = True


class CacheFull(RemoteError):
    code = "cache_full"
    retryable = True


class NodeDraining(RemoteError):
    code = "node_draining"
    retryable = True


class NodeInternalError(RemoteError):
    code = "internal_error"
    retryable = True


class KVNotWritten(NodeInternalError):
    """A block of a forward's range stored no keys/values for its new positions (or a wrong number of them).

    Its answer would be silently wrong from the next step on (every later step attends to zeros), so the forward
    fails instead. On the wire it is an internal error (the same code): the gateway routes around the node."""


class MissingBlocks(SwarmError):
    """No live node serves some blocks; ``blocks`` names them."""

    code = "missing_blocks"
    retryable = True

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        super().__init__(f"no live node serves blocks {format_block_ranges(blocks)}")


class NodeUnreachable(SwarmError):
    code = "node_unreachable"
    retryable = True


class MalformedReply(SwarmError):
    code = "malformed_reply"
    retryable = True


class BadReceipt(SwarmError):
    """A step reply without a valid receipt (``shared.receipts``): its output cannot be attributed to the node the
    gateway routed to, so it is treated like a lying node's (banned, its trust cut, its sessions moved)."""

    code = "bad_receipt"
    retryable = True


class NodeDistrusted(SwarmError):
    """A node whose outputs the gateway's checks no longer trust: its sessions move to trusted nodes."""

    code = "node_distrusted"
    retryable = True


class StepTimeout(SwarmError):
    code = "step_timeout"
    retryable = True


class ModelLoadError(SwarmError):
    code = "model_load_error"


class CacheApiMismatch(ModelLoadError):
    """The installed transformers' decoder layers name none of the cache keywords the span knows how to pass."""


class DhtLost(SwarmError):
    """This process's DHT child (or the p2pd it runs) exited while in use: nothing can be announced or looked up
    any more, so the process stops with an error for its supervisor to start it again (``shared.dht_process``)."""

    code = "dht_lost"


_REMOTE_ERRORS: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        ProtocolMismatch,
        BadRequest,
        UnknownSession,
        PositionOutOfRange,
        WrongSpan,
        Unauthorized,
        PushRefused,
        PushMissing,
        CacheFull,
        NodeDraining,
        NodeInternalError,
    )
}


def error_from_code(code: str, message: str) -> RemoteError:
    """Rebuild the typed error a node sent; unknown codes (a newer node) become ``RemoteError``."""
    cls = _REMOTE_ERRORS.get(code, RemoteError)
    error = cls(message)
    return error


def format_block_ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 7, 9, 10] -> '0:3, 7:8, 9:11' (half-open ranges, as spans are written everywhere)."""
    ranges: list[str] = []
    for block in sorted(blocks):
        if ranges and block == int(ranges[-1].split(":")[1]):
            start = ranges[-1].split(":")[0]
            ranges[-1] = f"{start}:{block + 1}"
        else:
            ranges.append(f"{block}:{block + 1}")
    return ", ".join(ranges)
