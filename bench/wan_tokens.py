"""Tokens per chain traversal across distance (issue 26): agent-style workloads, speculation on against plain push.

The same setup as ``bench/wan.py`` (a DHT, SmolLM2 on two nodes behind ``bench/latency_proxy.py``, the gateway's
engine in this process), two engines over the same nodes: ``push`` (``--speculative off``) and ``spec`` (the
defaults' push with ``--speculative ngram``: the grammar's forced tokens and prompt-lookup drafts). Per workload and
RTT: greedy decode tokens/s after the first token, and tokens per traversal (tokens / chain steps, the prefill's
included), both modes' tokens compared (they must be the same). Workloads:

* structured: a ``json_schema`` customer record extracted from a note;
* tool: a forced tool call (the call's JSON under its schema, as ``tool_choice`` builds it);
* agent: a second turn that re-emits the first turn's code with one change;
* novel: a short story, nothing to copy;
* mixed: 8 streams at once, two of each (aggregate tokens/s).

``chain`` is ``spec`` with ``--no-speculative-trees`` (every step's drafts one chain). ``--workloads`` and
``--modes`` run a subset (``mixed`` is the 8 streams).

    .venv/bin/python -m bench.wan_tokens --rtts 0,50 --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from bench.capacity import SPANS, LocalSwarm, smollm2_path, wait_covered
from bench.wan import free_port, start_proxy
from gateway.generation import Grammar, SamplingParams
from gateway.model import decode_loop
from gateway.model.engine import GenerationEngine, GenerationRequest
from gateway.settings import EngineSettings

NEW_TOKENS = 96
MODES: dict[str, dict[str, Any]] = {
    "push": {"speculative": "off"},
    "chain": {"speculative": "ngram", "speculative_trees": False},  # drafts verified as one chain per step
    "spec": {"speculative": "ngram"},  # the defaults: tree drafts where the drafter branches
}
CUSTOMER = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "phone": {"type": "string"},
        "city": {"type": "string"},
        "country": {"type": "string"},
        "age": {"type": "integer"},
        "vip": {"type": "boolean"},
    },
    "required": ["name", "email", "phone", "city", "country", "age", "vip"],
    "additionalProperties": False,
}
WEATHER_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
                "include_hourly_forecast": {"type": "boolean"},
            },
            "required": ["location", "unit", "days", "include_hourly_forecast"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
"""
WORKLOADS: dict[str, tuple[list[dict[str, str]], Grammar | None]] = {
    "structured": (
        [
            {
                "role": "user",
                "content": "Extract the customer as JSON: Maria Lopez (maria.lopez@example.com, +34 612 345 678)"
                " lives in Valencia, Spain, is 41 and is a VIP customer.",
            }
        ],
        Grammar("json_schema", json.dumps(CUSTOMER)),
    ),
    "tool": (
        [{"role": "user", "content": "What's the weather in Oslo for the next 3 days, in celsius, hour by hour?"}],
        Grammar("json_schema", json.dumps(WEATHER_CALL), "tools"),
    ),
    "agent": (
        [
            {"role": "user", "content": "Write a Python function for a moving average."},
            {"role": "assistant", "content": f"```python\n{CODE}```"},
            {"role": "user", "content": "Rename `values` to `samples` and show the whole function again."},
        ],
        None,
    ),
    "novel": ([{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}], None),
}


class Traversals:
    """Counts chain steps of every generation (``Generation.advance``; the prefill adds one per stream)."""

    def __init__(self) -> None:
        self.steps = 0
        original = decode_loop.Generation.advance

        async def counted(generation: decode_loop.Generation, round_: Any) -> None:
            self.steps += 1
            await original(generation, round_)

        decode_loop.Generation.advance = counted  # type: ignore[method-assign]


async def one(engine: GenerationEngine, prompt: list[int], grammar: Grammar | None) -> tuple[list[int], float]:
    """(the tokens, decode tokens/s after the first) of one greedy stream."""
    request = GenerationRequest(prompt, NEW_TOKENS, SamplingParams(temperature=0.0), grammar=grammar)
    stamps, tokens = [], []
    async for token in engine.generate(request):
        stamps.append(time.perf_counter())
        tokens.append(token)
    return tokens, (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


async def timed(run: Callable[[], Awaitable[int]], counter: Traversals, streams: int) -> tuple[float, float, int]:
    """(tokens/s, tokens per traversal, tokens) of ``run`` (which returns its token count)."""
    steps, began = counter.steps, time.perf_counter()
    tokens = await run()
    seconds = time.perf_counter() - began
    return tokens / seconds, tokens / (counter.steps - steps + streams), tokens


async def measure(
    engines: dict[str, GenerationEngine],
    prompts: dict[str, list[int]],
    counter: Traversals,
    rtt: float,
    repeats: int,
    workloads: set[str],
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, (_, grammar) in WORKLOADS.items():
        if name not in workloads:
            continue
        got: dict[str, list[tuple[float, float, list[int]]]] = {mode: [] for mode in engines}
        for _ in range(repeats):
            for mode, engine in engines.items():
                steps = counter.steps
                tokens, speed = await one(engine, prompts[name], grammar)
                got[mode].append((speed, len(tokens) / (counter.steps - steps + 1), tokens))
        same = len({tuple(runs[0][2]) for runs in got.values()}) == 1
        for mode, runs in got.items():
            rows.append(_row(name, mode, rtt, [r[0] for r in runs], [r[1] for r in runs], len(runs[0][2]), same))
    for mode, engine in engines.items() if "mixed" in workloads else ():
        speeds, per = [], []
        for _ in range(repeats):
            speed, tpt, tokens = await timed(lambda e=engine: _mixed(e, prompts), counter, 8)
            speeds.append(speed)
            per.append(tpt)
        rows.append(_row("mixed x8", mode, rtt, speeds, per, tokens, True))
    return rows


async def _mixed(engine: GenerationEngine, prompts: dict[str, list[int]]) -> int:
    jobs = [one(engine, prompts[name], grammar) for name, (_, grammar) in WORKLOADS.items() for _ in range(2)]
    return sum(len(tokens) for tokens, _ in await asyncio.gather(*jobs))


def _row(
    workload: str, mode: str, rtt: float, speeds: list[float], per: list[float], tokens: int, same: bool
) -> dict[str, Any]:
    row = {
        "workload": workload,
        "mode": mode,
        "rtt": rtt,
        "tok/s": statistics.median(speeds),
        "tok/traversal": statistics.median(per),
        "tokens": tokens,
        "same tokens": same,
    }
    print(
        f"  {workload} {mode} RTT {rtt * 1000:.0f} ms: {row['tok/s']:.1f} tok/s,"
        f" {row['tok/traversal']:.2f} tok/traversal, {tokens} tokens, same {same}",
        flush=True,
    )
    return row


async def run(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    model, rtt_file = smollm2_path(), workdir / "rtt"
    rtt_file.write_text("0")
    swarm = LocalSwarm(workdir, 1)
    proxy: subprocess.Popen[bytes] | None = None
    engines: dict[str, GenerationEngine] = {}
    try:
        swarm.start_dht()
        ports = [(free_port(), free_port()) for _ in SPANS]
        proxy = start_proxy(rtt_file, [f"127.0.0.1:{b}=127.0.0.1:{a}" for a, b in ports], swarm.env)
        nodes = [
            swarm.start_node(
                model,
                blocks,
                "none",
                ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{a}", "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{b}"],
            )
            for blocks, (a, b) in zip(SPANS, ports, strict=True)
        ]
        for node in nodes:
            swarm.wait_serving(node)
        for mode, extra in MODES.items():
            if mode not in args.modes:
                continue
            settings = EngineSettings(model=str(model), initial_peers=swarm.initial_peers, num_threads=1, **extra)
            engines[mode] = await GenerationEngine.create(settings)
            await wait_covered(engines[mode])
        tokenizer = engines["push"].tokenizer
        prompts = {
            name: tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
            for name, (chat, _) in WORKLOADS.items()
        }
        counter = Traversals()
        for engine in engines.values():  # warm-up: routes, grammar compiler, batchers
            await one(engine, prompts["structured"], WORKLOADS["structured"][1])
        rows = []
        for rtt in args.rtts:
            rtt_file.write_text(str(rtt))
            await asyncio.sleep(0.5)
            for engine in engines.values():
                for _ in range(4):
                    await asyncio.gather(*(engine.router._probe_one(p) for p in list(engine.router.rtts)))  # noqa: SLF001
            rows += await measure(engines, prompts, counter, rtt, args.repeats, args.workloads)
        return rows
    finally:
        for engine in engines.values():
            await engine.close()
        if proxy is not None:
            proxy.terminate()
            proxy.wait()
        swarm.close()


def table(rows: list[dict[str, Any]]) -> str:
    push = {(r["workload"], r["rtt"]): r for r in rows if r["mode"] == "push"}
    lines = [
        "| workload | RTT ms | mode | push tok/s | mode tok/s | mode / push | push tok/trav | mode tok/trav | same |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["mode"] == "push":
            continue
        p = push[(r["workload"], r["rtt"])]
        lines.append(
            f"| {r['workload']} | {r['rtt'] * 1000:.0f} | {r['mode']} | {p['tok/s']:.1f} | {r['tok/s']:.1f} |"
            f" {r['tok/s'] / p['tok/s']:.2f}x | {p['tok/traversal']:.2f} | {r['tok/traversal']:.2f} |"
            f" {'yes' if r['same tokens'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts", default="0,50,100", help="round-trip times in ms (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement, median (default: 1)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--workloads", default=",".join([*WORKLOADS, "mixed"]), help="default: %(default)s")
    parser.add_argument("--modes", default=",".join(MODES), help="push and others (default: %(default)s)")
    args = parser.parse_args()
    args.workloads, args.modes = set(args.workloads.split(",")), {"push", *args.modes.split(",")}
    args.rtts = [int(ms) / 1000 for ms in args.rtts.split(",")]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="swarmgate-wan-tokens-") as tmp:
        rows = asyncio.run(run(args, Path(tmp)))
    text = table(rows) + f"\n\n{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; greedy, {NEW_TOKENS} tokens max."
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wan_tokens.md").write_text(text + "\n")
    (args.out / "wan_tokens.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
