"""The gateway's view of the swarm as plain JSON-able data, for ``GET /v1/swarm`` and the status page."""

from __future__ import annotations

from typing import Any

from gateway.swarm.bans import BanList
from gateway.swarm.router import RouterStats
from gateway.swarm.verify.verifier import Verifier
from gateway.swarm.view import SwarmView
from shared.server_records import ServerRecord


def swarm_report(
    model: str,
    view: SwarmView,
    rtts: dict[str, float],
    bans: BanList,
    stats: RouterStats | None = None,
    waiting: dict[str, int] | None = None,
    verifier: Verifier | None = None,
) -> dict[str, Any]:
    """``waiting``: sessions waiting for a node, by the block range they lost ("15:30")."""
    missing = view.missing_blocks()
    return {
        "model": model,
        "num_blocks": view.num_blocks,
        "ready": not missing,
        "missing_blocks": missing,
        "blocks": _blocks(view),
        "nodes": [_node(server, rtts, bans, verifier) for server in sorted(view.servers.values(), key=_by_span)],
        "counters": (stats or RouterStats()).as_dict(),  # failovers, prefix replays, replayed tokens, bans, ...
        "failover_waiting": dict(waiting or {}),
        "checks": _check_counts(verifier),
    }


def _by_span(server: ServerRecord) -> tuple[int, str]:
    return server.start, server.peer_id


def _blocks(view: SwarmView) -> list[dict[str, Any]]:
    """Per block: how many online, dialable nodes serve it, and every node that announces it."""
    live = {s.peer_id for s in view.online()}
    blocks = []
    for block in range(view.num_blocks):
        serving = [s for s in view.servers.values() if s.start <= block < s.end]
        blocks.append(
            {
                "block": block,
                "live": sum(1 for s in serving if s.peer_id in live),
                "servers": [{"peer_id": s.peer_id, "state": s.state.value} for s in serving],
            }
        )
    return blocks


def _node(server: ServerRecord, rtts: dict[str, float], bans: BanList, verifier: Verifier | None) -> dict[str, Any]:
    ban = bans.status(server.peer_id)
    return {
        "peer_id": server.peer_id,
        "start": server.start,
        "end": server.end,
        "state": server.state.value,
        "throughput": server.throughput,
        "prefill_throughput": server.prefill_throughput,
        "cache_tokens_left": server.cache_tokens_left,
        "queue_depth": server.queue_depth,
        "rtt": rtts.get(server.peer_id),
        "reachability": server.reachability.value,  # direct, relayed (rtt through the relay), unreachable
        "relay_addrs": server.relay_addrs,
        "adapters": server.adapters,  # LoRA adapters the node serves for its span
        "banned": server.peer_id in bans.banned(),
        "ban_seconds_left": round(ban.banned_for, 3),
        "consecutive_failures": ban.failures,
        "version": server.version,
        "precision": server.precision,  # quant/dtype/device as announced
        "verification": _verification(verifier, server.peer_id),
    }


def _verification(verifier: Verifier | None, peer_id: str) -> dict[str, Any]:
    """The node's verification state, reputation and why (``gateway.swarm.verify.trust``)."""
    if verifier is None or not verifier.settings.enabled:
        return {"state": "off", "reputation": None, "reason": "verification is off (--no-verify)", "checks": {}}
    node = verifier.book.nodes.get(peer_id)
    if node is None:
        return {"state": "probation", "reputation": None, "reason": "not seen by the verifier yet", "checks": {}}
    reason = node.reason
    if node.self_checked:
        reason += " (a sole replica: checked against itself, which catches drift, not malice)"
    return {
        "state": node.state.value,
        "routed": verifier.book.routable(peer_id),
        "reputation": round(node.reputation, 4),
        "reason": reason,
        "checks": dict(node.checks),
        "evidence": node.evidence,  # the node's receipt of the step its latest lost check was about, if any
    }


def _check_counts(verifier: Verifier | None) -> list[dict[str, Any]]:
    """Checks run since start, by kind (challenge, spot, self) and result."""
    if verifier is None:
        return []
    return [{"kind": k, "result": r, "count": n} for (k, r), n in sorted(verifier.counts.items())]
