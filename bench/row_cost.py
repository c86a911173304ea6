"""What a verify row costs a batched decode forward (issue 26 part 4): the constant behind ``POSITION_COST``.

One node's span of SmolLM2 (blocks 0:15 of 30, float32 on the CPU, as ``bench/wan_tokens.py``'s nodes serve it), B
sessions each holding CONTEXT tokens. Per B: the median seconds of one packed forward of B decode rows (one token
each), and of the same rows with one of them a verify row of k + 1 tokens; printed as the extra seconds per extra
position, as a fraction of the B-row forward (the cost model's ``position_cost``).

    .venv/bin/python -m bench.row_cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.capacity import smollm2_path
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.span import BlockSpan, build_span

CONTEXT = 200


def timed(span: BlockSpan, rows: list[int], repeats: int) -> float:
    """Median seconds of one forward whose rows bring ``rows[b]`` tokens each, every session at CONTEXT."""
    sessions = [span.new_session_kv(range(span.start, span.end), CONTEXT + 64) for _ in rows]
    for kv in sessions:
        kv.length = CONTEXT  # what the keys hold does not change the cost
    hidden = torch.randn(len(rows), max(rows), span.hidden_size)
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        span(hidden, sessions, [CONTEXT] * len(rows), range(span.start, span.end), rows, packed=True)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,8", help="decode rows B (default: %(default)s)")
    parser.add_argument("--drafts", default="4,8", help="drafts k of the verify row (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a node's; default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = resolve_model(str(smollm2_path()))
    config = load_config(source)
    span = build_span(config, open_weights(source, config), 0, 15)
    print("| B decode rows | k drafts | B-row forward ms | with a verify row ms | per extra position |")
    print("| --- | --- | --- | --- | --- |")
    for batch in map(int, args.batches.split(",")):
        base = timed(span, [1] * batch, args.repeats)
        for k in map(int, args.drafts.split(",")):
            verify = timed(span, [k + 1] + [1] * (batch - 1), args.repeats)
            per = (verify - base) / k / base
            print(f"| {batch} | {k} | {base * 1000:.1f} | {verify * 1000:.1f} | {per:.3f} |", flush=True)
    print(f"\n{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {args.threads} torch thread(s), context {CONTEXT}.")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
