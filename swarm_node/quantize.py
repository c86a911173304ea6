"""Weight quantization of a span's linear layers with bitsandbytes: LLM.int8 (``int8``) or 4-bit NormalFloat (``nf4``).

What is quantized: the attention projections (q/k/v/o) and the MLP projections (gate/up/down) of every block — the
bulk of a dense block's weights — and every expert of a mixture-of-experts block. Norms, biases and the KV cache
stay in the compute dtype.

Defaults (``--quant auto``): ``none`` on the CPU — bitsandbytes 0.50 runs both kinds there, at a speed that depends
on the CPU (SmolLM2 single-stream decode with 0.50.2: about half float32's with either on an AVX2-only box; on an
AVX-512 box about 1.5x float32's with nf4 and 0.75x with int8: README's capacity table), but quantization changes
outputs and RAM is rarely what limits a CPU node; ``nf4`` on CUDA — a quarter of bfloat16's weight memory, so a
small GPU hosts about 3.5x more blocks, and bitsandbytes' 4-bit inference kernels keep batch-1 decode near bfloat16
speed (the default Petals chose too).
``int8`` is the more faithful of the two (outlier columns stay in 16 bits) but its matmuls are slower.

Unquantized projections on the CPU get the layout of ``swarm_node.cpu_projections`` (MKL's for one row, and where
the node measures that it pays, oneDNN's too for batches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from swarm_node.cpu_projections import BatchedCopy, TransposedLinear, keep_batched_copy
from swarm_node.quantized_experts import replace_experts
from swarm_node.span import BlockTransform

QuantSetting = Literal["auto", "none", "int8", "nf4"]
Quant = Literal["none", "int8", "nf4"]

# Llama-style names, Phi-3's fused ones, Falcon's and BLOOM's. Mixture-of-experts experts (3D tensors in
# transformers) are quantized too, one linear per expert (swarm_node/quantized_experts.py); routers stay as they are.
QUANTIZED_PROJECTIONS = frozenset(
    {
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        *("qkv_proj", "gate_up_proj"),
        *("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    }
)
INT8_OUTLIER_THRESHOLD = 6.0  # LLM.int8's default: input columns above it are multiplied in 16-bit instead


class _DropInt8CastNotice(logging.Filter):
    """bitsandbytes logs a warning on *every* LLM.int8 matmul whose input is not float16 (it casts, by design)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast from" not in record.getMessage()


def resolve_quant(setting: QuantSetting, device: torch.device) -> Quant:
    if setting == "auto":
        return "nf4" if device.type == "cuda" else "none"
    return setting


def block_transform(
    quant: Quant, compute_dtype: torch.dtype, device: torch.device | None = None, batched_copy: BatchedCopy = "auto"
) -> BlockTransform | None:
    """The per-block transform ``build_span`` applies while loading (None: keep ``nn.Linear`` layers).

    May time two matmul kernels (``batched_copy`` auto, unquantized on the CPU): call it off the event loop."""
    if quant == "none":
        if device is None or device.type != "cpu":
            return None
        keep = keep_batched_copy(compute_dtype, device, batched_copy)
        return lambda block: _transpose_projections(block, keep)

    def transform(block: nn.Module) -> nn.Module:
        return quantize_block(block, quant, compute_dtype)

    return transform


def _transpose_projections(block: nn.Module, batched_copy: bool) -> nn.Module:
    return _replace_projections(block, lambda linear: TransposedLinear(linear, batched_copy))


def quantize_block(block: nn.Module, quant: Quant, compute_dtype: torch.dtype) -> nn.Module:
    """Swap the block's projections (and experts) for bitsandbytes layers; weights are quantized when the block moves
    to a device."""

    def make(linear: nn.Linear) -> nn.Module:
        return _quantized_linear(linear, quant, compute_dtype)

    return replace_experts(_replace_projections(block, make), make)


def _replace_projections(block: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    targets = [
        (name, module)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        setattr(parent, child, make(linear))
    return block


def _quantized_linear(linear: nn.Linear, quant: Quant, compute_dtype: torch.dtype) -> nn.Module:
    # Imported only when asked for: bitsandbytes probes for CUDA libraries at import time.
    from bitsandbytes.nn.modules import Int8Params, Linear4bit, Linear8bitLt, Params4bit

    has_bias = linear.bias is not None
    weight = linear.weight.data
    module: nn.Module
    if quant == "int8":
        int8_logger = logging.getLogger("bitsandbytes.autograd._functions")
        if not any(isinstance(f, _DropInt8CastNotice) for f in int8_logger.filters):
            int8_logger.addFilter(_DropInt8CastNotice())
        module = Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            has_fp16_weights=False,
            threshold=INT8_OUTLIER_THRESHOLD,
            device="meta",
        )
        module.weight = Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        module = Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=has_bias,
            compute_dtype=compute_dtype,
            quant_type="nf4",
            device="meta",
        )
        module.weight = Params4bit(weight, requires_grad=False, quant_type="nf4")
    if linear.bias is not None:
        module.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return module
