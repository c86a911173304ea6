"""Wide-area benchmark: SmolLM2 through two nodes that the gateway and each other reach only across added latency.

A DHT, two ``swarm_node serve`` processes (blocks 0:15 and 15:30) and the gateway's ``GenerationEngine`` in this
process, as in ``bench/capacity.py``; but every node listens on a private port and announces the port of a
latency-adding TCP proxy (``bench/latency_proxy.py``) with ``--announce-maddrs``, so the gateway and the other node
reach it only through the delay. For each RTT (0 / 20 / 50 / 100 ms, set live through the proxy's control file, the
same nodes throughout) it measures

* single-stream decode tokens/s (after the first token) and time to first token, median of ``--repeats``;
* aggregate tokens/s of 8 concurrent greedy streams;
* round trips per token: decode steps the gateway relayed to a node, and hops whose input came node to node (push),
  counted by the gateway (``RouterStats``); in round-trip units a relayed hop costs 1, a pushed one 0.5;
* the floor lines: the RTT-0 time per token (compute, and loopback) + k * RTT, for k = 2 (a relay per node) and
  k = 1.5 (gateway -> A -> B -> gateway).

* copy-heavy decode tokens/s: one greedy chat stream that rewrites a given paragraph with one word changed (what
  prompt-lookup speculation drafts well), and its tokens, compared across modes.

With ``--modes push,relay,spec`` (what `make bench-wan` runs) one gateway engine pushes, one relays (both without
speculation) and one pushes with prompt-lookup speculation (``--speculative ngram``, adaptive), over the same nodes,
measured back to back at each RTT, so all see the same machine load. ``--modes default`` builds the engine with its
default settings (the only mode main's code has).

It prints one table and writes bench/results/wan.{md,png}. A benchmark, never a test.

    .venv/bin/python -m bench.wan                      # what `make bench-wan` runs
    .venv/bin/python -m bench.wan --rtts 0,50 --modes default --label main
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import step_trace_report
from bench.capacity import PROMPTS, SPANS, LocalSwarm, smollm2_path, streams, wait_covered
from gateway.generation import SamplingParams
from gateway.model.engine import GenerationEngine, GenerationRequest
from gateway.settings import EngineSettings
from shared import step_trace

STREAMS = 8


@dataclass
class Row:
    mode: str
    rtt: float  # seconds
    decode: list[float] = field(default_factory=list)  # single-stream decode tokens/s
    ttft: list[float] = field(default_factory=list)  # seconds
    aggregate: list[float] = field(default_factory=list)  # tokens/s of STREAMS streams
    relayed: float = 0.0  # per decode token
    pushed: float = 0.0
    single_windows: list[tuple[float, float]] = field(default_factory=list)  # wall clock of single-stream runs
    load: float = 0.0  # 1-minute load average once measured
    trace: str = ""  # where a single-stream token's time went (--trace)
    copy: list[float] = field(default_factory=list)  # copy-heavy single-stream decode tokens/s
    copy_tokens: list[int] = field(default_factory=list)


COPY_PARAGRAPH = (
    "The old lighthouse keeper climbed the narrow stairs every evening at dusk. He trimmed the wick, polished the"
    " great lens and wound the clockwork that turned the light. Ships far out at sea saw the beam sweep across the"
    " water and knew that the rocks were near. In the morning he wrote the weather in his logbook and slept until"
    " noon, dreaming of the ships that passed safely in the night."
)
COPY_REQUEST = "Rewrite this paragraph exactly, changing only the word 'evening' to 'night':\n\n" + COPY_PARAGRAPH
COPY_TOKENS = 96
MODE_SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "push": {"push": True, "speculative": "off"},
    "relay": {"push": False, "speculative": "off"},
    "spec": {"push": True, "speculative": "ngram"},
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def counters(engine: GenerationEngine) -> tuple[int, int]:
    """(hops relayed by the gateway, hops pushed node to node) so far; main's code counts relays as link rows."""
    stats = engine.router.stats
    relayed = getattr(stats, "relayed_hops", None)
    if relayed is None:
        links = engine._links  # noqa: SLF001 - the benchmark reads main's counter where the stats lack it
        return (links.rows if links is not None else 0), 0
    return relayed, getattr(stats, "pushed_hops", 0)


async def one_stream(engine: GenerationEngine, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it) of one greedy stream."""
    request = GenerationRequest(prompt, new_tokens, SamplingParams(temperature=0.0), ignore_eos=True)
    began = time.perf_counter()
    stamps = [time.perf_counter() async for _ in engine.generate(request)]
    return stamps[0] - began, (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def copy_stream(engine: GenerationEngine, prompt: list[int]) -> tuple[float, list[int]]:
    """(decode tokens/s after the first token, the tokens) of the copy-heavy greedy stream."""
    request = GenerationRequest(prompt, COPY_TOKENS, SamplingParams(temperature=0.0))
    stamps, tokens = [], []
    async for token in engine.generate(request):
        stamps.append(time.perf_counter())
        tokens.append(token)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), tokens


async def many_streams(engine: GenerationEngine, prompts: list[list[int]], new_tokens: int) -> float:
    return await streams(engine, prompts, STREAMS, new_tokens)


async def measure_rtt(
    engines: dict[str, GenerationEngine],
    prompts: list[list[int]],
    copy: list[int],
    rtt: float,
    args: argparse.Namespace,
) -> list[Row]:
    """One row per mode at ``rtt``; the modes take turns, run by run, so that the machine's load (shared, drifting)
    weighs on each alike."""
    rows = {mode: Row(mode, rtt) for mode in engines}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            speed, rows[mode].copy_tokens = await copy_stream(engine, copy)
            rows[mode].copy.append(speed)
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            row, before, began = rows[mode], counters(engine), time.time()
            ttft, decode = await one_stream(engine, prompts[0], args.new_tokens)
            after = counters(engine)
            row.single_windows.append((began, time.time()))
            row.ttft.append(ttft)
            row.decode.append(decode)
            decode_steps = args.repeats * (args.new_tokens - 1)  # every step after the prefill's
            row.relayed += (after[0] - before[0]) / decode_steps
            row.pushed += (after[1] - before[1]) / decode_steps
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            rows[mode].aggregate.append(await many_streams(engine, prompts, args.new_tokens))
    for row in rows.values():
        row.load = os.getloadavg()[0]
        print(
            f"  {row.mode} rtt {rtt * 1000:.0f} ms: 1 stream {statistics.median(row.decode):.1f} tok/s,"
            f" ttft {statistics.median(row.ttft) * 1000:.0f} ms, {STREAMS} streams"
            f" {statistics.median(row.aggregate):.1f} tok/s, copy-heavy {statistics.median(row.copy):.1f} tok/s"
            f" (load {row.load:.1f})",
            flush=True,
        )
    return list(rows.values())


def start_proxy(rtt_file: Path, mappings: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "bench.latency_proxy", "--rtt-file", str(rtt_file), *mappings]
    proxy = subprocess.Popen(command, stdout=subprocess.PIPE, env=env)
    if proxy.stdout is None or proxy.stdout.readline().strip() != b"ready":
        raise SystemExit("the latency proxy did not start")
    return proxy


async def run(args: argparse.Namespace, workdir: Path) -> list[Row]:
    model = smollm2_path()
    rtt_file = workdir / "rtt"
    rtt_file.write_text("0")
    swarm = LocalSwarm(workdir, args.threads)
    trace_log = workdir / "gateway-trace.log"
    if args.trace:  # every process marks its stages of a decode step (shared/step_trace.py)
        swarm.env[step_trace.ENV] = "1"
        step_trace.enable()
        handler = logging.FileHandler(trace_log)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        step_trace.logger.addHandler(handler)
    proxy: subprocess.Popen[bytes] | None = None
    try:
        swarm.start_dht()
        ports = [(free_port(), free_port()) for _ in SPANS]  # (private, proxy) per node
        mappings = [f"127.0.0.1:{public}=127.0.0.1:{private}" for private, public in ports]
        proxy = start_proxy(rtt_file, mappings, swarm.env)
        nodes = []
        for blocks, (private, public) in zip(SPANS, ports, strict=True):
            flags = ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{private}"]
            flags += ["--announce-maddrs", f"/ip4/127.0.0.1/tcp/{public}", *args.node_flag]
            nodes.append(swarm.start_node(model, blocks, "none", flags))
        for node in nodes:
            swarm.wait_serving(node)
        engines: dict[str, GenerationEngine] = {}
        try:
            for mode in args.modes:
                extra = MODE_SETTINGS[mode]
                settings = EngineSettings(
                    model=str(model), initial_peers=swarm.initial_peers, num_threads=args.threads, **extra
                )
                engines[mode] = await GenerationEngine.create(settings)
                await wait_covered(engines[mode])
            tokenizer = next(iter(engines.values())).tokenizer
            prompts = [tokenizer.encode(text) for text in PROMPTS]
            chat = [{"role": "user", "content": COPY_REQUEST}]
            copy = tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
            for engine in engines.values():
                await many_streams(engine, prompts, 4)  # warm-up: sessions, routes, batcher, allocator
            rows = []
            for rtt in args.rtts:
                rtt_file.write_text(str(rtt))
                await asyncio.sleep(0.5)  # the proxy polls its control file every 0.2 s
                for engine in engines.values():  # routers' RTT averages catch up (push decides by them)
                    for _ in range(4):
                        peers = list(engine.router.rtts)
                        await asyncio.gather(*(engine.router._probe_one(p) for p in peers))  # noqa: SLF001
                rows += await measure_rtt(engines, prompts, copy, rtt, args)
            if args.trace:
                kept = args.out / "trace"  # the raw records, for a closer look
                kept.mkdir(parents=True, exist_ok=True)
                for path in [trace_log, *(n.log for n in nodes)]:
                    shutil.copy(path, kept / path.name)
                for row in rows:
                    breakdown = step_trace_report.collect(trace_log, [n.log for n in nodes], row.single_windows)
                    row.trace = f"{row.mode}, RTT {row.rtt * 1000:.0f} ms, single stream:\n{breakdown}"
                    print(f"\n{row.trace}", flush=True)
            return rows
        finally:
            for engine in engines.values():
                await engine.close()
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait()
        swarm.close()


def table(rows: list[Row], label: str) -> str:
    head = ["mode", "RTT ms", "1 stream decode tok/s", "TTFT ms", f"{STREAMS} streams tok/s", "relays/token"]
    head += ["pushes/token", "RTTs/token", "floor c+2·RTT", "floor c+1.5·RTT", "vs 1.5 floor", "copy-heavy tok/s"]
    head.append("load")
    lines = [head, ["---"] * len(head)]
    computes = compute_times(rows)
    for row in rows:
        decode = statistics.median(row.decode)
        cells = [row.mode, f"{row.rtt * 1000:.0f}", f"{decode:.1f}", f"{statistics.median(row.ttft) * 1000:.0f}"]
        cells += [f"{statistics.median(row.aggregate):.1f}", f"{row.relayed:.2f}", f"{row.pushed:.2f}"]
        cells.append(f"{row.relayed + 0.5 * row.pushed:.2f}")
        compute = computes.get(row.mode)
        if compute is None:
            cells += ["—", "—", "—"]
        else:
            floor15 = 1 / (compute + 1.5 * row.rtt)
            cells += [f"{1 / (compute + 2 * row.rtt):.1f}", f"{floor15:.1f}", f"{decode / floor15:.2f}"]
        cells.append(f"{statistics.median(row.copy):.1f}")
        lines.append([*cells, f"{row.load:.1f}"])
    text = f"**{label}**\n\n" + "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
    for mode, compute in computes.items():
        text += (
            f"\n\nc ({mode}) = {compute * 1000:.1f} ms a token (single-stream decode at RTT 0: compute and loopback)."
        )
    by_key = {(row.mode, row.rtt): row for row in rows}
    for row in rows:
        relay = by_key.get(("relay", row.rtt))
        if row.mode == "push" and relay is not None:
            single = statistics.median(row.decode) / statistics.median(relay.decode)
            many = statistics.median(row.aggregate) / statistics.median(relay.aggregate)
            # The machine's load drifts between RTT levels: the relay run beside this one (c' + 2 RTT a token) gives
            # the compute c' of the same minutes, hence a floor for push (c' + 1.5 RTT) measured under the same load.
            same_load = 1 / statistics.median(relay.decode) - 2 * row.rtt
            floor = 1 / (same_load + 1.5 * row.rtt)
            decode = statistics.median(row.decode)
            text += (
                f"\n\nRTT {row.rtt * 1000:.0f} ms, push / relay: 1 stream {single:.2f}x, {STREAMS} streams {many:.2f}x;"
                f" push 1 stream {decode:.2f} tok/s against the floor c'+1.5·RTT {floor:.2f} tok/s"
                f" (c' = {same_load * 1000:.0f} ms from the relay run beside it): {decode / floor:.2f} of the floor."
                + paired(row, relay)
            )
    text += speculation_lines(rows, by_key)
    return text


def speculation_lines(rows: list[Row], by_key: dict[tuple[str, float], Row]) -> str:
    """Per RTT: the copy-heavy stream with speculation against push without it, and whether the tokens agree."""
    text = ""
    for row in rows:
        plain = by_key.get(("push", row.rtt))
        if row.mode != "spec" or plain is None:
            continue
        ratio = statistics.median(row.copy) / statistics.median(plain.copy)
        same = "identical" if row.copy_tokens == plain.copy_tokens else "DIFFERENT"
        text += (
            f"\n\nRTT {row.rtt * 1000:.0f} ms, copy-heavy prompt, spec / push without speculation: {ratio:.2f}x"
            f" ({statistics.median(row.copy):.1f} against {statistics.median(plain.copy):.1f} tok/s,"
            f" {len(row.copy_tokens)} tokens, {same})."
        )
    return text


def paired(push: Row, relay: Row) -> str:
    """The same comparisons run by run: each push run and the relay run right after it share the machine's load."""
    singles = [p / r for p, r in zip(push.decode, relay.decode, strict=True)]
    manys = [p / r for p, r in zip(push.aggregate, relay.aggregate, strict=True)]
    # per pair, push's time a token against the floor c'+1.5·RTT with c' from the relay run beside it
    floors = [(1 / r - 0.5 * push.rtt) * p for p, r in zip(push.decode, relay.decode, strict=True)]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    return (
        f" Run by run, median (range) of {len(singles)} pairs: 1 stream {spread(singles)}x,"
        f" {STREAMS} streams {spread(manys)}x, push against its floor {spread(floors)}."
    )


def compute_times(rows: list[Row]) -> dict[str, float]:
    """Per mode, seconds a token at RTT 0 (the floor lines' compute term)."""
    return {row.mode: 1 / statistics.median(row.decode) for row in rows if row.rtt == 0}


def plot(rows: list[Row], path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6.4, 4.2))
    for mode in dict.fromkeys(row.mode for row in rows):
        own = [row for row in rows if row.mode == mode]
        rtts = [row.rtt * 1000 for row in own]
        axes.plot(rtts, [statistics.median(r.decode) for r in own], marker="o", label=f"{mode}: 1 stream")
        axes.plot(
            rtts,
            [statistics.median(r.aggregate) / STREAMS for r in own],
            marker="s",
            label=f"{mode}: 8 streams, per stream",
        )
    computes = compute_times(rows)
    if computes:
        compute = min(computes.values())
        rtts = sorted({row.rtt for row in rows})
        for k in (2.0, 1.5):
            axes.plot(
                [r * 1000 for r in rtts],
                [1 / (compute + k * r) for r in rtts],
                linestyle="--",
                label=f"floor c + {k:g}·RTT",
            )
    axes.set_xlabel("added round-trip time per link, ms")
    axes.set_ylabel("decode tokens/s")
    axes.set_title(f"SmolLM2-135M over two CPU nodes behind added latency ({label})")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts", default="0,20,50,100", help="round-trip times in ms (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens per stream (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement, median (default: 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process (default: 1)")
    parser.add_argument("--node-flag", action="append", default=[], help="extra `swarm_node serve` flag (repeat)")
    parser.add_argument(
        "--modes", default="push,relay,spec", help="push, relay, spec and/or default (default: %(default)s)"
    )
    parser.add_argument("--label", default="this branch", help="names the run in the table (default: %(default)s)")
    parser.add_argument("--trace", action="store_true", help="print where a single-stream token's time goes")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the table and plot")
    args = parser.parse_args()
    args.rtts = [int(ms) / 1000 for ms in args.rtts.split(",")]
    args.modes = args.modes.split(",")
    return args


async def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="swarmgate-wan-") as tmp:
        rows = await run(args, Path(tmp))
    text = table(rows, args.label)
    if traces := [row.trace for row in rows if row.trace]:
        text += "\n\nWhere a single-stream token's time goes (`--trace`):\n\n```\n" + "\n\n".join(traces) + "\n```"
    text += f"\n\n{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.new_tokens} new tokens, greedy."
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wan.md").write_text(text + "\n")
    plot(rows, args.out / "wan.png", args.label)
    print(f"wrote {args.out}/wan.md and .png")


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the finally blocks, which stop the nodes and the proxy


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, _stop)
    asyncio.run(main())
