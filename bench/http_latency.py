"""Time to first token and tokens/s of one streamed request through the HTTP API, as a client sees them.

Start a swarm first (``make demo`` serves SmolLM2 on 127.0.0.1:8000), then:

    .venv/bin/python bench/http_latency.py [--url http://127.0.0.1:8000] [--max-tokens 128] [--runs 5]

Each run streams one greedy completion with ``ignore_eos`` (so every run generates exactly ``--max-tokens``
tokens) and times, from the request being sent: the first content chunk (TTFT), and the last one. Decode speed is
the tokens after the first over the time after the first; one warm-up request runs before the measured ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import httpx

PROMPT = "The history of the printing press begins"


@dataclass(frozen=True)
class Run:
    ttft: float  # seconds to the first content chunk
    total: float  # seconds to the last one
    tokens: int

    @property
    def decode_tps(self) -> float:
        return (self.tokens - 1) / (self.total - self.ttft) if self.total > self.ttft else float("nan")

    @property
    def overall_tps(self) -> float:
        return self.tokens / self.total


def model_id(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def one_run(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> Run:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    began = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter() - began
                first = first or last
    return Run(first, last, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default: %(default)s)")
    parser.add_argument("--prompt", default=PROMPT, help="prompt text (default: %(default)r)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per run (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=5, help="measured runs (default: %(default)s)")
    args = parser.parse_args()

    # trust_env=False: no proxy from the environment ever sees this traffic.
    with httpx.Client(base_url=args.url, trust_env=False, timeout=600) as client:
        model = model_id(client)
        one_run(client, model, args.prompt, 8)  # warm-up: first-request costs are not what we measure
        runs = [one_run(client, model, args.prompt, args.max_tokens) for _ in range(args.runs)]

    print(f"{model} via {args.url}: {args.max_tokens} tokens per run, {args.runs} runs (streamed, greedy)")
    print(f"{'run':>4} {'TTFT ms':>9} {'total s':>8} {'decode tok/s':>13} {'overall tok/s':>14}")
    for index, run in enumerate(runs, 1):
        print(f"{index:>4} {run.ttft * 1000:>9.0f} {run.total:>8.2f} {run.decode_tps:>13.1f} {run.overall_tps:>14.1f}")
    print(
        f"{'med':>4} {statistics.median(r.ttft for r in runs) * 1000:>9.0f} "
        f"{statistics.median(r.total for r in runs):>8.2f} {statistics.median(r.decode_tps for r in runs):>13.1f} "
        f"{statistics.median(r.overall_tps for r in runs):>14.1f}"
    )


if __name__ == "__main__":
    main()
