"""The simulator's speed-ups change no result: small runs give, number for number, what they gave before them.

``data/small_runs.json`` holds what these runs gave before the speed-ups (the DHT's view shared between readers at
one state, routes not searched twice for the same inputs). A change that is meant to change the simulation (a
fidelity fix, a change in our decision code) regenerates it with :func:`fingerprint` and says so in its commit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from sim.hardware import LLAMA_70B
from sim.scenario import Scenario, run
from sim.world import SimGateway

SMALL = replace(Scenario("small", model=LLAMA_70B, nodes=30).quick(), duration=200.0, measure_from=150.0)
RUNS = {
    "small": SMALL,
    "small-leave": replace(SMALL, name="leave", event="leave", event_at=170.0),
    "405b-60": replace(Scenario("405", nodes=60), duration=400.0, measure_from=300.0),
}
KEPT = Path(__file__).parent / "data" / "small_runs.json"


def fingerprint(scenario: Scenario) -> dict[str, object]:
    result = run(scenario)
    m = result.metrics
    return {
        "throughput": m.throughput,
        "bound": m.bound,
        "compute_bound": m.compute_bound,
        "decoding": m.decoding,
        "missing": m.missing,
        "finished": m.finished,
        "refused": m.refused,
        "lost": m.lost,
        "failovers": m.failovers,
        "moves": m.moves,
        "ttft": m.ttft,
        "spans": result.spans,
    }


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_small_run_gives_what_it_gave_before(name: str) -> None:
    kept = json.loads(KEPT.read_text())[name]
    now = json.loads(json.dumps(fingerprint(RUNS[name])))  # the same float round trip as the kept copy
    assert {k: v for k, v in now.items() if v != kept[k]} == {}


def test_the_route_memo_changes_no_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routes kept between searches (``SimGateway._memo_key``) are the ones a new search would find: the 405B run
    with every search made again gives the same numbers (its nodes' pools fill, so occupancy moves the routes)."""
    kept = json.loads(KEPT.read_text())["405b-60"]
    monkeypatch.setattr(SimGateway, "_memo_key", lambda _gateway, _view, _request: None)
    now = json.loads(json.dumps(fingerprint(RUNS["405b-60"])))
    assert {k: v for k, v in now.items() if v != kept[k]} == {}
