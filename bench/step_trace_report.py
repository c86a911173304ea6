"""Where a decode token's time goes: the median of each stage, from ``shared.step_trace`` records.

``bench/wan.py --trace`` collects the records of the gateway (in its process) and of each node (their logs), and this
module lines them up: a hop's records share the node's session id and the step's position; a token's two hops (A,
then B) are paired by the gateway's send times; the next token's send closes the gateway's own share (head,
sampling, embedding). Pushed and relayed tokens are reported apart.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from pathlib import Path

RECORD = re.compile(r"\b((?:gw|node)-[a-z-]+) ([0-9a-f]+) (\d+) (\d+\.\d+)$", re.MULTILINE)  # any log format

Key = tuple[str, int]  # (node session id, position)


def read(path: Path, events: dict[Key, dict[str, float]], owner: dict[str, str], name: str) -> None:
    """Add ``path``'s records (the first of each stage per key); node stages name their node's session ids."""
    for match in RECORD.finditer(path.read_text(errors="replace")):
        stage, session, position, stamp = match[1], match[2], int(match[3]), float(match[4])
        events[(session, position)].setdefault(stage, float(stamp))
        if stage.startswith("node-") and stage != "node-push-out":
            owner.setdefault(session, name)


def _hop(prefix: str, key: dict[str, float], into: str) -> list[tuple[str, str, str, dict[str, float]]]:
    return [
        (f"{prefix}: {into} → run", into, "node-run", key),
        (f"{prefix}: run (batcher and forward)", "node-run", "node-ran", key),
        (f"{prefix}: ran → answer sent", "node-ran", "node-answer", key),
        (f"{prefix}: answer → gateway", "node-answer", "gw-in", key),
    ]


def report(
    events: dict[Key, dict[str, float]], owner: dict[str, str], first: str, windows: list[tuple[float, float]]
) -> str:
    """Median ms of each stage of the tokens sent within ``windows`` (wall clock) whose both hops were traced, pushed
    and relayed tokens apart."""
    sent = sorted(
        (stages["gw-step-out"], key)
        for key, stages in events.items()
        if owner.get(key[0]) == first and any(a <= stages.get("gw-step-out", -1.0) <= b for a, b in windows)
    )
    later = {key: stages for key, stages in events.items() if owner.get(key[0]) not in (None, first)}
    rows: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    next_send = {(key[0], key[1] - 1): stamp for stamp, key in sent}
    for stamp, a_key in sent:
        candidates = [
            (stages.get("gw-pushed-out", stages.get("gw-step-out", 0.0)) - stamp, key)
            for key, stages in later.items()
            if key[1] == a_key[1]
        ]
        candidates = [(gap, key) for gap, key in candidates if -0.005 <= gap <= 2.0]
        if not candidates:
            continue
        b_key = min(candidates)[1]
        a, b = events[a_key], later[b_key]
        pushed = "node-push-in" in b and "gw-pushed-out" in b
        kind = "pushed" if pushed else "relayed"
        spans = [("gateway → A", "gw-step-out", "node-step-in", a), *_hop("A", a, "node-step-in")]
        if pushed:  # A marks its push under B's session id
            pushed_by_a = {**a, **{s: t for s, t in b.items() if s == "node-push-out"}}
            spans.append(("A: ran → push sent", "node-ran", "node-push-out", pushed_by_a))
            spans.append(("push A → B", "node-push-out", "node-push-in", b))
            spans.append(("(the gateway's ask reaches B)", "gw-pushed-out", "node-pushed-in", b))
            spans += _hop("B", b, "node-push-in")
        else:
            relayed_to_b = {**b, **{s: t for s, t in a.items() if s == "gw-in"}}
            spans.append(("gateway: A's answer → B's step sent", "gw-in", "gw-step-out", relayed_to_b))
            spans.append(("gateway → B", "gw-step-out", "node-step-in", b))
            spans += _hop("B", b, "node-step-in")
        for label, x, y, where in spans:
            if x in where and y in where:
                rows[kind][label].append(where[y] - where[x])
        if (following := next_send.get(a_key)) is not None and "gw-in" in b:
            rows[kind]["gateway: B's answer → next token sent"].append(following - b["gw-in"])
            rows[kind]["token (A sent → next A sent)"].append(following - a["gw-step-out"])
    lines = []
    for kind, by_stage in rows.items():
        count = len(by_stage.get("token (A sent → next A sent)", []))
        lines.append(f"{kind} tokens ({count} traced): median ms per stage")
        lines += [f"  {label:45s} {statistics.median(v) * 1000:7.1f}" for label, v in by_stage.items()]
    return "\n".join(lines)


def collect(gateway_log: Path, node_logs: list[Path], windows: list[tuple[float, float]]) -> str:
    """The report of the tokens sent within ``windows``; ``node_logs`` in chain order."""
    events: dict[Key, dict[str, float]] = defaultdict(dict)
    owner: dict[str, str] = {}
    for index, path in enumerate(node_logs):
        read(path, events, owner, f"node{index}")
    read(gateway_log, events, owner, "gateway")
    return report(events, owner, "node0", windows)
