"""`make bench-verify`: what the gateway's checks of nodes (gateway.swarm.verify) catch, flag and cost, in-process.

Runs the gateway's own comparison (``compare``), tolerance table (``tolerances``) and policy (``TrustBook``) on
SmolLM2-135M spans built as nodes build them (``bench.verify_spans``), without processes, to stay in minutes:

1. honest pairs: every replica's session output against every replica's forward, replicas mixing float32,
   bfloat16, int8 and nf4; counts pairs flagged (must be 0) over >= 10,000 comparisons;
2. lying replicas (noise, stale-cache, wrong-weights, low-precision, lazy): whether a challenge refuses them, and
   how many checked steps until the policy takes them out of routing when references are drawn at random from the
   honest mix (median and worst of 5 runs);
3. cost: the extra compute the default check rate spends, over simulated sessions;
4. single-stream decode through real local nodes with checks off and on (``bench.verify_decode``).

Writes bench/results/verify.md. ``--quick`` runs fewer comparisons (a smoke run).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import verify_decode
from bench.verify_spans import PRECISIONS, Replica, replicas, smollm2_folder
from gateway.model.head import build_head
from gateway.swarm.verify.compare import compare
from gateway.swarm.verify.spot_checks import side_of
from gateway.swarm.verify.tolerances import FLOAT32, HALF, INT8, NF4, Precision, tolerance_for
from gateway.swarm.verify.trust import TrustBook
from gateway.swarm.verify.verifier import VerifySettings
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights

RESULTS = Path(__file__).parent / "results" / "verify.md"
SPANS = [(0, 2), (14, 16), (28, 30)]  # the start, middle and end of SmolLM2's 30 blocks
TOKENS = 8
Output = Callable[[torch.Tensor], torch.Tensor]
TOLERANCES = {"float32": FLOAT32, "half": HALF, "int8": INT8, "nf4": NF4}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def precision(replica: Replica) -> Precision:
    return Precision(replica.quant, str(replica.dtype).removeprefix("torch."), "cpu")


def embedded(seed: int) -> torch.Tensor:
    """Embeddings of seeded random tokens [1, T, D]: inputs at the scale real hidden states start from."""
    embed = EMBEDDING["smollm2"]
    ids = torch.randint(0, embed.num_embeddings, (1, TOKENS), generator=torch.Generator().manual_seed(seed))
    return embed(ids).float()


EMBEDDING: dict[str, torch.nn.Embedding] = {}


def load_embedding(model: str) -> None:
    source = resolve_model(model)
    config = load_config(source)
    EMBEDDING["smollm2"] = build_head(config, open_weights(source, config)).embed_tokens


def honest_pairs(spans: dict[tuple[int, int], list[Replica]], seeds: int) -> tuple[int, int, dict[str, Worst]]:
    """(comparisons, flagged, the worst measured per pair class) over every span, seed and ordered replica pair."""
    comparisons = flagged = 0
    worst: dict[str, Worst] = {}
    for reps in spans.values():
        for seed in range(seeds):
            x = embedded(seed)
            sessions = [r.session(x) for r in reps]
            forwards = [r.forward(x) for r in reps]
            for a, want in zip(reps, forwards, strict=True):
                for b, got in zip(reps, sessions, strict=True):
                    verdict = compare(x, want, got, tolerance_for(precision(a), precision(b)))
                    comparisons += 1
                    flagged += not verdict.agrees
                    key = pair_class(precision(a), precision(b))
                    cosine, rel = worst.get(key, (1.0, 0.0))
                    worst[key] = (min(cosine, verdict.cosine), max(rel, verdict.rel_l2))
    return comparisons, flagged, worst


Worst = tuple[float, float]  # (lowest cosine, highest relative L2)


def pair_class(a: Precision, b: Precision) -> str:
    """The looser side's error class, as ``tolerance_for`` picks the tolerance."""
    return min((a.error_class, b.error_class), key=lambda c: ["nf4", "int8", "half", "float32"].index(c))


def liars(reference: Replica, nf4: Replica) -> dict[str, Output]:
    """Lying session outputs, on a float32 span announced as float32."""
    span = reference.span

    def noise(x: torch.Tensor) -> torch.Tensor:
        out = reference.session(x)
        return out + 0.01 * out.norm(dim=-1, keepdim=True) / out.shape[-1] ** 0.5 * torch.randn_like(out)

    def stale(x: torch.Tensor) -> torch.Tensor:  # the decode step attends to a cache nobody wrote
        blocks = range(span.start, span.end)
        head = reference.forward(x[:, :-1])
        kv = span.new_session_kv(blocks, x.shape[1])
        kv.length = x.shape[1] - 1  # positions counted, keys and values left zero
        tail = span(x[:, -1:], [kv], [x.shape[1] - 1], blocks)
        return torch.cat([head, tail], dim=1)

    wrong = wrong_block(reference)
    return {
        "noise": noise,
        "stale-cache": stale,
        "wrong-weights": wrong.session,
        "low-precision": nf4.session,
        "lazy": lambda x: x.clone(),
    }


def wrong_block(reference: Replica) -> Replica:
    """The same span with its first block's weights drawn again from another seed (same spread per tensor)."""
    copy = replicas_cache["float"]
    layer = copy.span.layers[str(copy.span.start)]
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in layer.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * param.std())
    return copy


replicas_cache: dict[str, Replica] = {}


def steps_to_catch(lie: Output, honest: list[Replica], rng: random.Random, limit: int = 64, pick: str = "best") -> int:
    """Checked steps until the liar is out of routing, as ``run_spot_check`` judges (a third replica breaking ties);
    ``pick``: "best" takes references as the gateway does (the most precise first), "random" draws them from the
    honest mix. ``limit + 1`` when never caught."""
    book = TrustBook(VerifySettings().threshold)
    for peer in ("liar", *(r.name for r in honest)):
        book.see(peer, (0, 1))
        book.passed(peer, "bench")
    liar_precision = Precision()  # it announces float32
    for step in range(1, limit + 1):
        x = embedded(rng.randrange(1 << 30))
        got = lie(x)
        ordered = sorted(honest, key=lambda r: precision(r).rank, reverse=True)
        reference, third = ordered[:2] if pick == "best" else rng.sample(honest, 2)
        want = reference.forward(x)
        if compare(x, want, got, tolerance_for(liar_precision, precision(reference))).agrees:
            book.agreed("liar")
            continue
        judged = third_says(x, got, want, third.forward(x), liar_precision, precision(reference), precision(third))
        if judged == "node":
            book.agreed("liar")
            continue
        book.lost("liar", judged, outvoted=judged == "reference")
        if not book.routable("liar"):
            return step
    return limit + 1


def third_says(
    x: torch.Tensor,
    got: torch.Tensor,
    want: torch.Tensor,
    third: torch.Tensor,
    mine: Precision,
    reference: Precision,
    theirs: Precision,
) -> str:
    """Whom a third replica sides with, as ``spot_checks.side_of`` decides."""
    with_node = compare(x, third, got, tolerance_for(mine, theirs)).agrees
    with_reference = compare(x, third, want, tolerance_for(reference, theirs)).agrees
    return side_of(with_node, with_reference)


def challenge_refuses(lie: Output, honest: list[Replica]) -> bool:
    """Probation: the liar's session output against the reference the gateway would pick (the most precise)."""
    x = embedded(7)
    reference = max(honest, key=lambda r: precision(r).rank)
    return not compare(x, reference.forward(x), lie(x), tolerance_for(Precision(), precision(reference))).agrees


def compute_overhead(rate: float, sessions: int = 2000, prompt: int = 64, new: int = 128) -> tuple[float, float]:
    """(extra compute of established nodes, of new ones) at ``rate``: check tokens over served tokens."""
    book, rng = TrustBook(), random.Random(0)
    book.see("old", (0, 1))
    book.see("new", (0, 1))
    for _ in range(40):
        book.agreed("old")
    overheads = []
    for peer in ("old", "new"):
        served = checked = 0
        for _ in range(sessions):
            steps = [(prompt, prompt)] + [(1, prompt + i + 1) for i in range(new)]
            for tokens, total in steps:
                served += tokens
                if rng.random() < book.check_probability(peer, tokens, total, rate):
                    checked += total
        overheads.append(checked / served)
    return overheads[0], overheads[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few comparisons")
    parser.add_argument("--no-decode", action="store_true", help="skip the stream through real nodes (part 4)")
    parser.add_argument("--spans", default=None, help="spans to compare, e.g. 0:2,14:16 (default: SPANS)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    began = time.monotonic()
    model = str(smollm2_folder())
    load_embedding(model)
    if args.spans:
        SPANS[:] = [(int(a), int(b)) for a, b in (part.split(":") for part in args.spans.split(","))]
    spans = {span: replicas(model, *span, PRECISIONS) for span in SPANS}
    per_seed = len(SPANS) * len(PRECISIONS) ** 2
    seeds = 4 if args.quick else -(-10_000 // per_seed)
    comparisons, flagged, worst = honest_pairs(spans, seeds)
    honest = spans[SPANS[len(SPANS) // 2]]
    float_replica = honest[0]
    replicas_cache["float"] = replicas(model, *SPANS[len(SPANS) // 2], PRECISIONS[:1])[0]
    nf4 = next(r for r in honest if r.quant == "nf4" and r.dtype == torch.float32)
    rows = []
    for name, lie in liars(float_replica, nf4).items():
        best = [steps_to_catch(lie, honest, random.Random(run)) for run in range(5)]
        drawn = [steps_to_catch(lie, honest, random.Random(run), pick="random") for run in range(5)]
        refused = challenge_refuses(lie, honest)
        rows.append((name, refused, statistics.median(best), max(best), statistics.median(drawn), max(drawn)))
    overhead = compute_overhead(VerifySettings().check_rate)
    report = render(comparisons, flagged, worst, rows, overhead, time.monotonic() - began)
    if not args.no_decode:
        report += "\n" + verify_decode.main() + "\n"
    print(report)
    RESULTS.write_text(report)


def render(
    comparisons: int,
    flagged: int,
    worst: dict[str, Worst],
    rows: list[tuple[str, bool, float, int, float, int]],
    overhead: tuple[float, float],
    seconds: float,
) -> str:
    lines = [
        "# Verification of nodes (`make bench-verify`)",
        "",
        f"SmolLM2-135M on this machine's CPU, spans {', '.join(f'{a}:{b}' for a, b in SPANS)}, {TOKENS} positions"
        f" (embeddings of seeded random tokens); replicas {', '.join(f'{q}/{dtype_name(d)}' for q, d in PRECISIONS)};"
        f" {seconds:.0f} s.",
        "",
        f"Honest pairs: **{flagged} flagged of {comparisons} comparisons** (every replica's session against every"
        " replica's forward). The worst measured per pair class, against its tolerance:",
        "",
        "| pair (looser side) | lowest cosine | tolerance | highest relative L2 | tolerance |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, (cosine, rel) in sorted(worst.items()):
        tolerance = TOLERANCES[key]
        lines.append(f"| {key} | {cosine:.5f} | {tolerance.min_cosine} | {rel:.4f} | {tolerance.max_rel_l2} |")
    lines += [
        "",
        "| lying replica (announces float32) | refused by its challenge | checked steps until out of routing:"
        " references as the gateway picks them (median, worst of 5) | references drawn at random (median, worst) |",
        "| --- | --- | --- | --- |",
    ]
    for name, refused, best, best_worst, drawn, drawn_worst in rows:
        lines.append(
            f"| {name} | {'yes' if refused else 'no'} | {caught(best, best_worst)} | {caught(drawn, drawn_worst)} |"
        )
    old, new = overhead
    lines += [
        "",
        "The gateway takes the most precise routed replica as the reference and the next as the tie-breaker; drawn"
        " at random from the mix, a lie smaller than int8's or nf4's own error passes against those.",
        "",
        f"Extra compute at the default check rate ({VerifySettings().check_rate:g}): {100 * old:.2f} % for"
        f" established nodes, {100 * new:.2f} % for new or low-reputation ones (checked 4x as often);"
        " simulated sessions of 64 prompt and 128 new tokens.",
        "",
    ]
    return "\n".join(lines)


def caught(median: float, worst: int) -> str:
    return f"{median:g}, {worst}" if worst <= 64 else f"{median:g}, not within 64"


if __name__ == "__main__":
    main()
