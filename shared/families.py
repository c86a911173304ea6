"""Supported model families: which transformers classes make up a block span and the gateway's head.

We drive transformers' own decoder-layer classes (so every family matches transformers exactly and follows its
releases) and give them our own KV cache and an explicit attention mask. A family is plain data: the classes to
build, how its GGUF files are laid out, and which layers use sliding-window attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from shared.errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    """One supported architecture.

    ``gguf_arch`` is the ``general.architecture`` name llama.cpp writes; ``gguf_permutes_qk`` says whether its
    converter permuted the Q/K projection rows (llama.cpp does this for the llama arch only, to suit its RoPE layout).
    """

    name: str
    decoder_layer: type[nn.Module]
    rotary_embedding: type[nn.Module]
    rms_norm: type[nn.Module]
    gguf_arch: str
    gguf_permutes_qk: bool
    sliding_window: Callable[[PretrainedConfig, int], int | None]


def _no_window(config: PretrainedConfig, layer_idx: int) -> None:
    return None


def _mistral_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    return getattr(config, "sliding_window", None)


def _per_layer_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    # Qwen2/Qwen3 decide per layer through config.layer_types (set from use_sliding_window / max_window_layers).
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] == "sliding_attention":
        return getattr(config, "sliding_window", None)
    return None


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama",
        modeling_llama.LlamaDecoderLayer,
        modeling_llama.LlamaRotaryEmbedding,
        modeling_llama.LlamaRMSNorm,
        gguf_arch="llama",
        gguf_permutes_qk=True,
        sliding_window=_no_window,
    ),
    "mistral": Family(
        "mistral",
        modeling_mistral.MistralDecoderLayer,
        modeling_mistral.MistralRotaryEmbedding,
        modeling_mistral.MistralRMSNorm,
        gguf_arch="llama",  # llama.cpp converts Mistral checkpoints to its llama arch
        gguf_permutes_qk=True,
        sliding_window=_mistral_window,
    ),
    "qwen2": Family(
        "qwen2",
        modeling_qwen2.Qwen2DecoderLayer,
        modeling_qwen2.Qwen2RotaryEmbedding,
        modeling_qwen2.Qwen2RMSNorm,
        gguf_arch="qwen2",
        gguf_permutes_qk=False,
        sliding_window=_per_layer_window,
    ),
    "qwen3": Family(
        "qwen3",
        modeling_qwen3.Qwen3DecoderLayer,
        modeling_qwen3.Qwen3RotaryEmbedding,
        modeling_qwen3.Qwen3RMSNorm,
        gguf_arch="qwen3",
        gguf_permutes_qk=False,
        sliding_window=_per_layer_window,
    ),
}


def family_of(config: PretrainedConfig) -> Family:
    try:
        return FAMILIES[config.model_type]
    except KeyError:
        supported = ", ".join(sorted(FAMILIES))
        raise ModelLoadError(f"model type {config.model_type!r} is not supported (supported: {supported})") from None
