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
* mixed: 8 streams at once, two of each (aggregate tokens/s: their tokens over the time the slowest takes);
* sustained: 8 clients, two a workload, for ``--window`` seconds, each sending its next request as the last ends,
  every request a different one (``bench/request_variants.py``): the tokens they receive a second.

``draft`` is ``--speculative draft --draft-model PATH`` (default: the served model's weights rounded to bfloat16,
``bench/draft_copy.py``); its greedy agreement with the served model (the per-token acceptance a greedy verify sees)
is measured teacher-forced over push's tokens of every workload. ``chain`` is ``spec`` with
``--no-speculative-trees`` (every step's drafts one chain). ``pipe`` is ``spec`` with ``--speculative-pipeline
auto`` (the next verify frame leaves before the last returns where acceptance is above the cost model's break-even;
the default since stop 50, so ``spec`` does so too) and ``pipe-always`` with ``always`` (frames ahead whenever a
round drafts); ``spec-unpiped`` and ``draft-unpiped`` are ``spec`` and ``draft`` with ``off`` (drafting and
verifying take turns). For the modes that may pipeline the notes count the frames sent ahead and how many of those
were taken (their guess held) rather than voided. ``push-again`` is push again in an
engine of its own, the A/A control: its ratio to push is what the run's noise alone gives (modes take turns in ABBA
order, so no mode is always run first). ``--workloads`` and ``--modes`` run a
subset (``mixed`` and ``sustained`` are the 8 streams). Besides the table, each speculating mode's accepted /
drafted tokens (the grammar's forced tokens count as drafts) and a plot of tok/s against RTT per workload
(``wan_tokens.png``).

    .venv/bin/python -m bench.wan_tokens                                # RTT 0/50/100, push, spec and draft
    .venv/bin/python -m bench.wan_tokens --rtts 50 --workloads mixed,sustained --modes spec --repeats 3
    .venv/bin/python -m bench.wan_tokens --modes spec,pipe,pipe-always --workloads tool,agent --out bench/results/pipe
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import request_variants
from bench.capacity import SPANS, LocalSwarm, smollm2_path, wait_covered
from bench.draft_copy import bfloat16_copy, greedy_agreement
from bench.wan import free_port, start_proxy
from gateway.generation import Grammar, SamplingParams
from gateway.metrics import GatewayMetrics, current_metrics
from gateway.model import decode_loop
from gateway.model.engine import GenerationEngine, GenerationRequest
from gateway.model.suffix_drafts import OutputStore
from gateway.settings import EngineSettings

NEW_TOKENS = 96
WINDOW = 60.0  # seconds of the sustained run
MODES: dict[str, dict[str, Any]] = {
    "push": {"speculative": "off"},
    "chain": {"speculative": "ngram", "speculative_trees": False},  # drafts verified as one chain per step
    # the defaults: trees off since part 3 measured no gain; frames ahead where they pay (`auto`) since stop 50
    "spec": {"speculative": "ngram"},
    "spec-unpiped": {"speculative": "ngram", "speculative_pipeline": "off"},  # the defaults before stop 50
    "draft": {"speculative": "draft"},  # draft_model: the --draft-model argument; frames ahead drafted as others travel
    "draft-unpiped": {"speculative": "draft", "speculative_pipeline": "off"},  # drafting takes turns with verifying
    # pipelined verification (issue 26 part 5): frames ahead where the cost model finds they pay (as `spec` since
    # `auto` became the default), or always
    "pipe": {"speculative": "ngram", "speculative_pipeline": "auto"},
    "pipe-always": {"speculative": "ngram", "speculative_pipeline": "always"},
    # push's settings in an engine of its own: the A/A control, whose ratio to push is the run's noise
    "push-again": {"speculative": "off"},
}
DEFAULT_MODES = "push,spec,draft"
PUSH_TOKENS: dict[str, list[int]] = {}  # per workload, push's greedy tokens of the last run (for the draft agreement)
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
CODE = request_variants.FUNCTIONS[0][0]  # moving_average, the agent workload's first turn
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


class Acceptance:
    """Accepted and drafted tokens per mode, read from the gateway's speculation counters around each run."""

    def __init__(self) -> None:
        self.metrics = GatewayMetrics()
        current_metrics.set(self.metrics)  # the engine's tasks, created after this, count into it
        self.by_mode: dict[str, list[float]] = {}

    def _read(self) -> tuple[float, float]:
        registry = self.metrics.registry
        drafted = registry.get_sample_value("swarmgate_spec_draft_tokens_total") or 0.0
        return drafted, registry.get_sample_value("swarmgate_spec_accepted_tokens_total") or 0.0

    async def counted(self, mode: str, run: Awaitable[Any]) -> Any:
        (drafted, accepted), result = self._read(), await run
        now = self._read()
        totals = self.by_mode.setdefault(mode, [0.0, 0.0])
        totals[0] += now[0] - drafted
        totals[1] += now[1] - accepted
        return result


class Frames:
    """Frames sent ahead per mode, and how many of them a round took (their guess held) rather than voided."""

    def __init__(self) -> None:
        self.mode = ""
        self.by_mode: dict[str, list[int]] = {}
        original = decode_loop.Generation._take_ahead

        def counted(generation: decode_loop.Generation, position: int, fed: int) -> Any:
            sent = generation.ahead is not None
            taken = original(generation, position, fed)
            totals = self.by_mode.setdefault(self.mode, [0, 0])
            totals[0] += sent
            totals[1] += taken is not None
            return taken

        decode_loop.Generation._take_ahead = counted  # type: ignore[method-assign,assignment]

    def note(self, mode: str) -> str | None:
        sent, taken = self.by_mode.get(mode, [0, 0])
        return f"{mode}: {sent} frames sent ahead, {taken} taken, {sent - taken} voided" if sent else None


FRAMES = Frames()


class Traversals:
    """Counts chain steps of every generation (``Generation.advance``; the prefill adds one per stream)."""

    def __init__(self) -> None:
        self.steps = 0
        original = decode_loop.Generation.advance

        async def counted(generation: decode_loop.Generation, round_: Any) -> None:
            self.steps += 1
            await original(generation, round_)

        decode_loop.Generation.advance = counted  # type: ignore[method-assign,assignment]


async def one(
    engine: GenerationEngine, prompt: list[int], grammar: Grammar | None, new_tokens: int = NEW_TOKENS
) -> tuple[list[int], float]:
    """(the tokens, decode tokens/s after the first) of one greedy stream of up to ``new_tokens``."""
    request = GenerationRequest(prompt, new_tokens, SamplingParams(temperature=0.0), grammar=grammar)
    stamps, tokens = [], []
    async for token in engine.generate(request):
        stamps.append(time.perf_counter())
        tokens.append(token)
    return tokens, (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


@dataclass
class Run:
    """One measured run: tokens/s as it times them; every stream it finished, its tokens by label (each label's
    are compared across modes and repeats); and what tokens per traversal count: the tokens it emitted, those of
    streams it cut off included, and the streams it began (each one's prefill is a chain step)."""

    speed: float
    finished: dict[str, list[int]]
    emitted: int
    begun: int


async def measure(
    engines: dict[str, GenerationEngine],
    prompts: dict[str, list[int]],
    variants: dict[str, list[list[int]]],
    counter: Traversals,
    acceptance: Acceptance,
    rtt: float,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, (_, grammar) in WORKLOADS.items():
        if name not in args.workloads:
            continue
        single = functools.partial(
            _single, name=name, prompt=prompts[name], grammar=grammar, new_tokens=args.new_tokens
        )
        named, push = await _measured(name, single, engines, counter, acceptance, rtt, args.repeats)
        rows += named
        PUSH_TOKENS[name] = push.finished[name]
    if "mixed" in args.workloads:
        mixed = functools.partial(_mixed, prompts=prompts, new_tokens=args.new_tokens)
        rows += (await _measured("mixed x8", mixed, engines, counter, acceptance, rtt, args.repeats))[0]
    if "sustained" in args.workloads:
        sustained = functools.partial(_sustained, variants=variants, window=args.window, new_tokens=args.new_tokens)
        rows += (await _measured("sustained x8", sustained, engines, counter, acceptance, rtt, args.repeats))[0]
    return rows


async def _measured(
    workload: str,
    run: Callable[[GenerationEngine], Awaitable[Run]],
    engines: dict[str, GenerationEngine],
    counter: Traversals,
    acceptance: Acceptance,
    rtt: float,
    repeats: int,
) -> tuple[list[dict[str, Any]], Run]:
    """A row a mode for ``run`` done ``repeats`` times a mode, modes taking turns, and push's first run. Tokens a
    traversal count each stream's prefill as a chain step; the same tokens: every finished stream's, compared with
    the same stream's in every other run that finished it, of every mode."""
    got: dict[str, list[tuple[Run, float]]] = {mode: [] for mode in engines}
    for repeat in range(repeats):
        # ABBA: the modes' order turns each repeat, so no mode always runs first (or always after another's run)
        order = list(engines.items()) if repeat % 2 == 0 else list(engines.items())[::-1]
        for mode, engine in order:
            _forget_outputs(engine)
            steps, FRAMES.mode = counter.steps, mode
            done = await acceptance.counted(mode, run(engine))
            got[mode].append((done, done.emitted / (counter.steps - steps + done.begun)))
    runs = [done.finished for mode_runs in got.values() for done, _ in mode_runs]
    same = all(len({tuple(r[label]) for r in runs if label in r}) == 1 for label in set().union(*runs))
    rows = [
        _row(workload, mode, rtt, [r.speed for r, _ in runs_], [p for _, p in runs_], runs_[0][0].emitted, same)
        for mode, runs_ in got.items()
    ]
    return rows, got["push"][0][0]


def _forget_outputs(engine: GenerationEngine) -> None:
    """Every run starts with no earlier outputs for suffix drafts to copy: the same prompts run at every RTT and in
    the warm-up, and a greedy rerun of a prompt would draft its whole answer from the last run's (novel chat would
    measure 4 tokens per traversal). What a run's own streams emit stays: that is the suffix drafts' cross-session
    store at work (the mixed run has each workload twice, started together)."""
    engine.outputs = OutputStore(words=engine.outputs.words)


async def _single(
    engine: GenerationEngine, name: str, prompt: list[int], grammar: Grammar | None, new_tokens: int
) -> Run:
    """One stream: decode tokens/s after the first token."""
    tokens, speed = await one(engine, prompt, grammar, new_tokens)
    return Run(speed, {name: tokens}, len(tokens), 1)


async def _mixed(engine: GenerationEngine, prompts: dict[str, list[int]], new_tokens: int) -> Run:
    """The 8 streams at once (two of each workload, in a fixed order): their aggregate tokens/s, prefills included."""
    names = [name for name in WORKLOADS for _ in range(2)]
    began = time.perf_counter()
    ended: dict[str, float] = {}  # the aggregate is the slowest stream's: say which workload ends when

    async def timed_one(name: str) -> list[int]:
        tokens, _ = await one(engine, prompts[name], WORKLOADS[name][1], new_tokens)
        ended[name] = time.perf_counter() - began
        return tokens

    outputs = await asyncio.gather(*(timed_one(name) for name in names))
    print("    mixed streams done at: " + ", ".join(f"{name} {ended[name]:.1f} s" for name in WORKLOADS), flush=True)
    emitted = sum(map(len, outputs))
    finished = {f"{name} {index}": tokens for index, (name, tokens) in enumerate(zip(names, outputs, strict=True))}
    return Run(emitted / (time.perf_counter() - began), finished, emitted, len(names))


async def _sustained(
    engine: GenerationEngine, variants: dict[str, list[list[int]]], window: float, new_tokens: int
) -> Run:
    """8 clients, two a workload, each sending its next request as the last ends, for ``window`` seconds: the tokens
    they receive in it a second. Client c of a workload sends its variants c, c + 2, c + 4, ... (none repeats unless
    a client gets through half its workload's pool, which is printed). At the window's end the streams under way
    are cut off (as a client that disconnects): their tokens so far count, their streams are not compared."""
    finished: dict[str, list[int]] = {}
    emitted = begun = 0
    sent: dict[str, int] = dict.fromkeys(WORKLOADS, 0)

    async def client(name: str, first: int) -> None:
        nonlocal emitted, begun
        for index in itertools.count(first, 2):
            prompt, tokens = variants[name][index % len(variants[name])], []
            begun, sent[name] = begun + 1, sent[name] + 1
            request = GenerationRequest(prompt, new_tokens, SamplingParams(temperature=0.0), grammar=WORKLOADS[name][1])
            async for token in engine.generate(request):
                tokens.append(token)
                emitted += 1
            finished[f"{name} {index}"] = tokens

    clients = [asyncio.create_task(client(name, first)) for name in WORKLOADS for first in range(2)]
    # the window is the measurement: the clients run until it ends, whatever they are doing then
    await asyncio.sleep(window)
    received = emitted
    for task in clients:
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    wrapped = [name for name, count in sent.items() if count > len(variants[name])]
    print(
        "    sustained requests begun: " + ", ".join(f"{name} {count}" for name, count in sent.items())
        + (f" (some repeated: {', '.join(wrapped)})" if wrapped else ""),
        flush=True,
    )  # fmt: skip
    return Run(received / window, finished, received, begun)


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


def _accepted(mode: str, totals: list[float]) -> str:
    drafted, accepted = totals
    share = f"{accepted / drafted:.2f}" if drafted else "-"
    return f"{mode}: {accepted:.0f} of {drafted:.0f} drafted tokens accepted ({share}; every run and RTT)"


async def _agreement(engine: GenerationEngine, prompts: dict[str, list[int]]) -> str:
    """The draft model's greedy token against push's, teacher-forced over every workload's output."""
    if engine.draft_model is None:
        return "no draft model loaded"
    parts, hits, total = [], 0, 0
    for name, tokens in PUSH_TOKENS.items():
        got, count = await asyncio.to_thread(greedy_agreement, engine.draft_model.model, prompts[name], tokens)
        parts.append(f"{name} {got / count:.2f}")
        hits, total = hits + got, total + count
    return f"draft model greedy agreement with the served model: {hits / max(total, 1):.3f} ({', '.join(parts)})"


async def run(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], list[str]]:
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
            if mode.startswith("draft"):
                extra = {**extra, "draft_model": str(args.draft_model or bfloat16_copy(model, workdir / "draft"))}
            settings = EngineSettings(model=str(model), initial_peers=swarm.initial_peers, num_threads=1, **extra)
            engines[mode] = await GenerationEngine.create(settings)
            await wait_covered(engines[mode])
        tokenizer = engines["push"].tokenizer
        prompts = {name: encode(tokenizer, chat) for name, (chat, _) in WORKLOADS.items()}
        variants = {
            name: [encode(tokenizer, vary(index)) for index in range(request_variants.DISTINCT[name])]
            for name, vary in request_variants.VARIANTS.items()
        }
        counter, acceptance = Traversals(), Acceptance()
        for engine in engines.values():  # warm-up: routes, grammar compiler, batchers
            await one(engine, prompts["structured"], WORKLOADS["structured"][1])
        rows = []
        for rtt in args.rtts:
            rtt_file.write_text(str(rtt))
            await asyncio.sleep(0.5)
            for engine in engines.values():
                for _ in range(4):
                    await asyncio.gather(*(engine.router._probe_one(p) for p in list(engine.router.rtts)))  # noqa: SLF001
            rows += await measure(engines, prompts, variants, counter, acceptance, rtt, args)
        notes = [_accepted(mode, totals) for mode, totals in acceptance.by_mode.items() if mode != "push"]
        notes += [note for mode in engines if (note := FRAMES.note(mode)) is not None]
        if "draft" in engines:
            notes.append(await _agreement(engines["draft"], prompts))
        return rows, notes
    finally:
        for engine in engines.values():
            await engine.close()
        if proxy is not None:
            proxy.terminate()
            proxy.wait()
        swarm.close()


def encode(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    """A chat's prompt tokens, as the gateway's chat template renders it."""
    prompt: list[int] = tokenizer.encode(
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    return prompt


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


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """tok/s against RTT, one panel per workload, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    figure, axes = pyplot.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.4), squeeze=False)
    for panel, workload in zip(axes[0], workloads, strict=True):
        own = [r for r in rows if r["workload"] == workload]
        for mode in dict.fromkeys(r["mode"] for r in own):
            line = [r for r in own if r["mode"] == mode]
            panel.plot([r["rtt"] * 1000 for r in line], [r["tok/s"] for r in line], marker="o", label=mode)
        panel.set_title(workload)
        panel.set_xlabel("RTT per link, ms")
        panel.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][0].legend(fontsize=7)
    figure.suptitle("SmolLM2-135M, two CPU nodes behind added latency: speculation against plain push", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts", default="0,50,100", help="round-trip times in ms (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement, median (default: 1)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--workloads", default=",".join([*WORKLOADS, "mixed", "sustained"]), help="default: %(default)s"
    )
    parser.add_argument(
        "--window", type=float, default=WINDOW, help="seconds of the sustained run (default: %(default)s)"
    )
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"of {','.join(MODES)} (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="per stream (default: %(default)s)")
    parser.add_argument("--draft-model", help="draft mode's model (default: a bfloat16 copy of the served one)")
    args = parser.parse_args()
    args.workloads, args.modes = set(args.workloads.split(",")), {"push", *args.modes.split(",")}
    args.rtts = [int(ms) / 1000 for ms in args.rtts.split(",")]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="swarmgate-wan-tokens-") as tmp:
        rows, notes = asyncio.run(run(args, Path(tmp)))
    load = os.getloadavg()
    text = "\n\n".join(
        [
            table(rows),
            "\n".join(f"- {note}" for note in notes),
            f"{os.cpu_count()} CPUs, load {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end;"
            f" greedy, {args.new_tokens} tokens max.",
        ]
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wan_tokens.md").write_text(text + "\n")
    (args.out / "wan_tokens.json").write_text(json.dumps(rows, indent=1))
    if len(args.rtts) > 1:
        plot(rows, args.out / "wan_tokens.png")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
