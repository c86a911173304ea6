"""GPU readiness (``make gpu-check``): every family's span on CUDA against transformers on the same device.

For each family a random model of a small but GPU-sized shape (hidden 1024, 4 blocks, vocab 8192; MoE 8 experts,
2 per token) is built by transformers and saved as safetensors, then loaded by our own readers:

* **bfloat16**: our span (all blocks) + head in bfloat16 against transformers' model in bfloat16, final hidden
  states (after the final norm) on 2 prompts: relative error ||ours - theirs|| / ||theirs|| <= 0.05
  (bfloat16 keeps 8 bits of mantissa; kernel order alone moves a 4-block stack ~1e-2);
* **nf4**: our nf4 span (bitsandbytes 4-bit, bfloat16 compute) against transformers' float32 model:
  relative error <= 0.5 (the CPU tolerance of tests/unit/swarm_node/test_quantize.py for random weights);
* **greedy float32**: two spans (split in the middle) + head, 20 greedy tokens equal to transformers ``generate``
  in float32 on the same device (TF32 off);
* **decode speed**: aggregate tokens/s of 1, 8 and 32 concurrent sessions stepping together through one span of
  all blocks + head (bfloat16 and nf4), after a 16-token prefill each.

Runs in a few minutes on one GPU; needs torch with CUDA, transformers, bitsandbytes (and this repo's packages) but no
network and no model download. On a machine without CUDA it says so and exits 0 (``--device cpu`` runs the same checks
on the CPU, with ``--hidden 64`` to make it quick: a check of this script, not of a GPU).

    python -m bench.gpu_check
    python -m bench.gpu_check --families mixtral bloom --streams 1 8
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from gateway.model.head import ModelHead, build_head
from shared.model_source import load_config, resolve_model
from shared.weights import WeightReader, open_weights
from swarm_node.kv_cache import SessionKV
from swarm_node.quantize import block_transform
from swarm_node.span import BlockSpan, build_span

HAVE_BNB = importlib.util.find_spec("bitsandbytes") is not None  # without it, the nf4 rows are skipped (said so)
BF16_TOLERANCE = 0.05
NF4_TOLERANCE = 0.5
GREEDY_TOKENS = 20
PREFILL = 16
SPEED_STEPS = 24


@dataclass(frozen=True)
class Shape:
    hidden: int = 1024
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 8192

    @property
    def common(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.hidden * 11 // 4,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden // self.heads,
            "max_position_embeddings": 512,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        }


def _configs(shape: Shape) -> dict[str, Callable[[], transformers.PretrainedConfig]]:
    common = shape.common
    moe = {"num_experts_per_tok": 2, "moe_intermediate_size": shape.hidden, "num_experts": 8}
    layer_types = ["sliding_attention", "full_attention"] * (shape.layers // 2)
    gemma = {**common, "sliding_window": 8, "layer_types": layer_types, "query_pre_attn_scalar": shape.hidden // 16}
    falcon = {k: common[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")}
    falcon.update(alibi=False, parallel_attn=True, bias=False, bos_token_id=None, eos_token_id=None)
    return {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=shape.hidden),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, **moe),
        "falcon": lambda: transformers.FalconConfig(**falcon, new_decoder_architecture=False, multi_query=True),
        "falcon_new": lambda: transformers.FalconConfig(
            **falcon, new_decoder_architecture=True, num_kv_heads=shape.kv_heads
        ),
        "bloom": lambda: transformers.BloomConfig(
            vocab_size=shape.vocab, hidden_size=shape.hidden, n_layer=shape.layers, n_head=shape.heads
        ),
        "gemma2": lambda: transformers.Gemma2Config(**gemma),
        "gemma3": lambda: transformers.Gemma3TextConfig(**gemma),
        "phi3": lambda: transformers.Phi3Config(
            **{k: v for k, v in common.items() if k not in ("head_dim", "pad_token_id")}, pad_token_id=0
        ),
    }


@dataclass
class Loaded:
    folder: Path
    config: transformers.PretrainedConfig
    reader: WeightReader


def save_random(config: transformers.PretrainedConfig, folder: Path) -> Loaded:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    source = resolve_model(str(folder))
    ours = load_config(source)
    return Loaded(folder, ours, open_weights(source, ours))


def reference(folder: Path, dtype: torch.dtype, device: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()


def run_spans(spans: list[BlockSpan], head: ModelHead, ids: torch.Tensor, sessions: list[SessionKV]) -> torch.Tensor:
    """Final hidden states [1, T, D] (after the final norm) of ids through the spans from position 0."""
    hidden = head.embed(ids)
    for span, kv in zip(spans, sessions, strict=True):
        hidden = span(hidden, [kv], [kv.length], range(span.start, span.end))
    return hidden


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.float() - theirs.float()).norm() / theirs.float().norm())


def hidden_error(
    loaded: Loaded, model: transformers.PreTrainedModel, dtype: torch.dtype, quant: str, device: str
) -> float:
    layers = loaded.config.num_hidden_layers
    transform = block_transform("nf4", dtype) if quant == "nf4" else None
    span = build_span(loaded.config, loaded.reader, 0, layers, dtype=dtype, device=device, transform=transform)
    head = build_head(loaded.config, loaded.reader, dtype=dtype, device=device)
    errors = []
    for seed, length in ((1, 13), (2, 40)):
        ids = torch.randint(0, loaded.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
        ids = ids.to(device)
        kv = span.new_session_kv(range(0, layers), length)
        with torch.inference_mode():
            ours = head.norm(run_spans([span], head, ids, [kv]))
            theirs = model.base_model(ids).last_hidden_state
        errors.append(relative_error(ours, theirs))
    return max(errors)


def greedy_equal(loaded: Loaded, model: transformers.PreTrainedModel, device: str) -> tuple[bool, str]:
    """Whether 20 greedy tokens equal ``generate``'s; else where they part and how close our top two logits were
    there (a near-tie on a random model flips on any kernel difference)."""
    layers = loaded.config.num_hidden_layers
    cut = layers // 2
    spans = [build_span(loaded.config, loaded.reader, a, b, device=device) for a, b in ((0, cut), (cut, layers))]
    head = build_head(loaded.config, loaded.reader, device=device)
    prompt = torch.randint(0, loaded.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    prompt = prompt.to(device)
    with torch.inference_mode():
        expected = model.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, 12:].tolist()
    sessions = [span.new_session_kv(range(span.start, span.end), 12 + GREEDY_TOKENS) for span in spans]
    ids, tokens, gaps = prompt, [], []
    for _ in range(GREEDY_TOKENS):
        logits = head.logits(run_spans(spans, head, ids, sessions))
        top2 = logits[0, -1].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        tokens.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([[tokens[-1]]], device=device)
    if tokens == expected:
        return True, ""
    first = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
    return False, f" (first differs at token {first}, where our top-2 logit gap is {gaps[first]:.2e})"


def decode_speed(loaded: Loaded, dtype: torch.dtype, quant: str, device: str, streams: list[int]) -> list[float]:
    """Aggregate tokens/s of each stream count, every session one row of one batched forward per step."""
    layers = loaded.config.num_hidden_layers
    transform = block_transform("nf4", dtype) if quant == "nf4" else None
    span = build_span(loaded.config, loaded.reader, 0, layers, dtype=dtype, device=device, transform=transform)
    head = build_head(loaded.config, loaded.reader, dtype=dtype, device=device)
    blocks = range(0, layers)
    rates = []
    for count in streams:
        sessions = [span.new_session_kv(blocks, PREFILL + SPEED_STEPS + 4) for _ in range(count)]
        ids = torch.randint(0, loaded.config.vocab_size, (count, PREFILL), device=device)
        with torch.inference_mode():
            logits = head.logits(span(head.embed(ids), sessions, [0] * count, blocks))
            tokens = logits[:, -1:].argmax(-1)  # [B, 1]
            for step in range(SPEED_STEPS + 3):
                if step == 3:  # after warm-up
                    _sync(device)
                    began = time.perf_counter()
                starts = [kv.length for kv in sessions]
                tokens = head.logits(span(head.embed(tokens), sessions, starts, blocks))[:, -1:].argmax(-1)
            _sync(device)
        rates.append(count * SPEED_STEPS / (time.perf_counter() - began))
    return rates


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_family(
    name: str, config: transformers.PretrainedConfig, device: str, streams: list[int], workdir: Path
) -> bool:
    loaded = save_random(config, workdir / name)
    ok = True
    fp32 = reference(loaded.folder, torch.float32, device)
    bf16 = reference(loaded.folder, torch.bfloat16, device)
    bf16_error = hidden_error(loaded, bf16, torch.bfloat16, "none", device)
    baseline = relative_error(_hidden(bf16, loaded, device), _hidden(fp32, loaded, device))
    ok &= _report(name, "bf16 vs transformers bf16", bf16_error, BF16_TOLERANCE, f"(theirs vs fp32 {baseline:.4f})")
    del bf16
    if HAVE_BNB:
        nf4_error = hidden_error(loaded, fp32, torch.bfloat16, "nf4", device)
        ok &= _report(name, "nf4 vs transformers fp32", nf4_error, NF4_TOLERANCE)
    equal, detail = greedy_equal(loaded, fp32, device)
    print(
        f"{name:11s} greedy fp32 {GREEDY_TOKENS} tokens equal to generate: {'ok' if equal else 'FAIL'}{detail}",
        flush=True,
    )
    ok &= equal
    del fp32
    for dtype, quant in ((torch.bfloat16, "none"), (torch.bfloat16, "nf4"))[: 2 if HAVE_BNB else 1]:
        rates = decode_speed(loaded, dtype, quant, device, streams)
        cells = "  ".join(f"{count:>2} streams {rate:8.1f} tok/s" for count, rate in zip(streams, rates, strict=True))
        print(f"{name:11s} decode {quant if quant != 'none' else 'bf16':4s}  {cells}", flush=True)
    return ok


def _probe(loaded: Loaded, device: str) -> torch.Tensor:
    return torch.randint(0, loaded.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(1)).to(device)


def _hidden(model: transformers.PreTrainedModel, loaded: Loaded, device: str) -> torch.Tensor:
    with torch.inference_mode():
        return model.base_model(_probe(loaded, device)).last_hidden_state


def _report(name: str, what: str, error: float, tolerance: float, note: str = "") -> bool:
    ok = error <= tolerance
    print(f"{name:11s} {what}: rel err {error:.4f} <= {tolerance} {'ok' if ok else 'FAIL'} {note}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check of this script only)")
    parser.add_argument("--families", nargs="*", help="a subset of the families (default: all)")
    parser.add_argument("--streams", nargs="*", type=int, default=[1, 8, 32])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing to check (exit 0)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 must mean float32 for the greedy check
    torch.backends.cudnn.allow_tf32 = False
    configs = _configs(Shape(hidden=args.hidden, layers=args.layers, heads=max(4, args.hidden // 64)))
    names = args.families or list(configs)
    if args.device.startswith("cuda"):
        print(f"gpu-check on {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}", flush=True)
    if not HAVE_BNB:
        print("gpu-check: bitsandbytes is not installed: nf4 checks and speeds skipped", flush=True)
    failed = []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                if not check_family(name, configs[name](), args.device, args.streams, Path(tmp)):
                    failed.append(name)
            except Exception:
                traceback.print_exc()
                print(f"{name:11s} ERROR (traceback above)", flush=True)
                failed.append(name)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    print(f"gpu-check: {len(names) - len(failed)}/{len(names)} families ok in {time.perf_counter() - began:.0f}s")
    if failed:
        print(f"gpu-check: FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
