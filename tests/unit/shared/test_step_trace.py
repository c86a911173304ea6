"""The step trace: silent until enabled; enabled, its records (in the gateway's and a node's log formats) line up
into a per-stage breakdown of pushed and relayed tokens (bench/step_trace_report.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import step_trace_report
from shared import step_trace

A, B = "a" * 32, "b" * 32  # node session ids: A's on the first node, B's on the second
A2, B2 = "c" * 32, "d" * 32  # a relayed chain's


@pytest.fixture
def trace_level() -> Iterator[None]:
    level = step_trace.logger.level
    yield
    step_trace.logger.setLevel(level)


def test_marks_are_silent_until_enabled(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, trace_level: None
) -> None:
    caplog.handler.setLevel(logging.DEBUG)
    step_trace.logger.setLevel(logging.INFO)
    step_trace.mark("gw-step-out", A, 7)
    monkeypatch.setenv(step_trace.ENV, "0")
    step_trace.enable_from_env()
    step_trace.mark("gw-step-out", A, 7)
    assert not caplog.records
    monkeypatch.setenv(step_trace.ENV, "1")
    step_trace.enable_from_env()
    step_trace.mark("gw-step-out", A, 7)
    (record,) = caplog.records
    stage, session, position, stamp = record.getMessage().split()
    assert (stage, session, position) == ("gw-step-out", A, "7") and float(stamp) > 0


def _gateway_line(stage: str, session: str, position: int, ms: float) -> str:
    return f"swarmgate.step_trace: {stage} {session} {position} {1000 + ms / 1000:.6f}\n"


def _node_line(stage: str, session: str, position: int, ms: float) -> str:  # hivemind's handler's format
    prefix = "Nov 30 23:37:52.974 [DEBUG] [swarmgate.step_trace.mark:30]"
    return f"{prefix} {stage} {session} {position} {1000 + ms / 1000:.6f}\n"


def _blocks(text: str) -> dict[str, dict[str, float]]:
    """{header: {stage: ms}} of a report."""
    blocks: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("  "):
            stages = blocks[line] = {}
            continue
        label, ms = line.strip().rsplit(maxsplit=1)
        stages[label.strip()] = float(ms)
    return blocks


def test_the_report_lines_up_both_hops_of_a_pushed_and_of_a_relayed_token(tmp_path: Path) -> None:
    gateway = [  # ms: a pushed token at position 5, the next one sent at 150; a relayed one at position 9
        ("gw-step-out", A, 5, 0), ("gw-pushed-out", B, 5, 0.1), ("gw-in", A, 5, 60), ("gw-in", B, 5, 140),
        ("gw-step-out", A, 6, 150),
        ("gw-step-out", A2, 9, 500), ("gw-in", A2, 9, 560), ("gw-step-out", B2, 9, 561), ("gw-in", B2, 9, 620),
        ("gw-step-out", A2, 10, 630),
    ]  # fmt: skip
    first = [
        ("node-step-in", A, 5, 25), ("node-run", A, 5, 26), ("node-ran", A, 5, 46), ("node-push-out", B, 5, 47),
        ("node-answer", A, 5, 48),
        ("node-step-in", A2, 9, 525), ("node-run", A2, 9, 526), ("node-ran", A2, 9, 545), ("node-answer", A2, 9, 546),
    ]  # fmt: skip
    second = [
        ("node-pushed-in", B, 5, 26), ("node-push-in", B, 5, 75), ("node-run", B, 5, 76), ("node-ran", B, 5, 110),
        ("node-answer", B, 5, 112),
        ("node-step-in", B2, 9, 586), ("node-run", B2, 9, 587), ("node-ran", B2, 9, 600), ("node-answer", B2, 9, 601),
    ]  # fmt: skip
    paths = [tmp_path / "gateway.log", tmp_path / "a.log", tmp_path / "b.log"]
    for path, records, line in zip(paths, [gateway, first, second], [_gateway_line, *[_node_line] * 2], strict=True):
        path.write_text("noise\n" + "".join(line(*record) for record in records))
    blocks = _blocks(step_trace_report.collect(paths[0], paths[1:], [(1000.0, 1001.0)]))
    assert set(blocks) == {
        "pushed tokens (1 traced): median ms per stage",
        "relayed tokens (1 traced): median ms per stage",
    }
    pushed = blocks["pushed tokens (1 traced): median ms per stage"]
    relayed = blocks["relayed tokens (1 traced): median ms per stage"]
    assert pushed["gateway → A"] == pytest.approx(25, abs=0.01)
    assert pushed["A: ran → push sent"] == pytest.approx(1, abs=0.01)
    assert pushed["push A → B"] == pytest.approx(28, abs=0.01)
    assert pushed["(the gateway's ask reaches B)"] == pytest.approx(25.9, abs=0.01)
    assert pushed["B: node-push-in → run"] == pytest.approx(1, abs=0.01)
    assert pushed["B: answer → gateway"] == pytest.approx(28, abs=0.01)
    assert pushed["gateway: B's answer → next token sent"] == pytest.approx(10, abs=0.01)
    assert pushed["token (A sent → next A sent)"] == pytest.approx(150, abs=0.01)
    assert "push A → B" not in relayed
    assert relayed["gateway: A's answer → B's step sent"] == pytest.approx(1, abs=0.01)
    assert relayed["gateway → B"] == pytest.approx(25, abs=0.01)
    assert relayed["B: run (batcher and forward)"] == pytest.approx(13, abs=0.01)
    assert relayed["token (A sent → next A sent)"] == pytest.approx(130, abs=0.01)
    # Outside the window, nothing is reported.
    assert step_trace_report.collect(paths[0], paths[1:], [(0.0, 999.0)]) == ""
