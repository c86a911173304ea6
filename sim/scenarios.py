"""The scenarios of ``python -m sim``: steady state at three sizes for two model shapes, and the events."""

from __future__ import annotations

from dataclasses import replace

from sim.hardware import LLAMA_70B, LLAMA_405B
from sim.scenario import Scenario


def full() -> list[Scenario]:
    steady = [
        Scenario(f"{model.name} steady", model=model, nodes=nodes, duration=duration, measure_from=measure)
        for model in (LLAMA_405B, LLAMA_70B)
        for nodes, duration, measure in ((100, 720.0, 420.0), (300, 540.0, 360.0), (1000, 420.0, 330.0))
    ]
    # Traffic starts at 120 s; sessions last minutes (a few tokens/s each), so the decoding population is steady
    # about 200-300 s later: the windows start there (shorter at 1,000 nodes, for CPU time).
    base = Scenario("events", nodes=100, duration=720.0, traffic_from=120.0, measure_from=420.0, event_at=540.0)
    events = [
        replace(base, name="20 % of nodes leave at once", event="leave"),
        replace(base, name="Europe goes dark", event="region", region="eu"),
        replace(base, name="5 % slow-but-honest nodes", slow_share=0.05, event=None),
        replace(base, name="flash crowd (5x arrivals, 60 s)", event="flash"),
    ]
    return steady + events


def quick() -> list[Scenario]:
    """Two small, short runs (tests, ``python -m sim --quick``)."""
    return [
        Scenario("70b steady (quick)", model=LLAMA_70B, nodes=40).quick(),
        replace(Scenario("70b: 20 % leave (quick)", model=LLAMA_70B, nodes=40, event="leave").quick()),
    ]
