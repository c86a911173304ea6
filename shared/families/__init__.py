"""Supported model families: which transformers classes make up a block span and the gateway's head.

We drive transformers' own decoder-layer classes (so every family matches transformers exactly and follows its
releases) and give them our own KV cache and an explicit attention mask. A family is plain data (``Family``): the
classes to build, how its checkpoints and GGUF files name tensors, how its layers are called, and which layers use
sliding-window attention.

A process imports only the transformers modeling module of the family its model belongs to (``family_of`` builds
that one family on first use): each module costs an import at start, and a node serves one model.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

from torch import nn
from transformers import PretrainedConfig

from shared.errors import ModelLoadError
from shared.families.family import ExpertLayout, Family, TensorLayout

__all__ = ["FAMILY_NAMES", "ExpertLayout", "Family", "TensorLayout", "context_length", "family_of"]

# BLOOM (ALiBi) has no position table; its models were trained on sequences of this length.
ALIBI_CONTEXT = 2048


def _no_window(config: PretrainedConfig, layer_idx: int) -> None:
    return None


def _model_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    # Mistral, Mixtral, Phi-3, Qwen3-MoE: one window for every layer when the config sets one.
    return getattr(config, "sliding_window", None) or None


def _per_layer_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    # Qwen2, Qwen2-MoE, Gemma 2/3 decide per layer through config.layer_types.
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] == "sliding_attention":
        return getattr(config, "sliding_window", None)
    return None


def _layer_type(config: PretrainedConfig, layer_idx: int) -> str:
    return str(config.layer_types[layer_idx])


def _rms(norm: type[nn.Module]) -> Callable[[PretrainedConfig], nn.Module]:
    def build(config: PretrainedConfig) -> nn.Module:
        return norm(config.hidden_size, eps=config.rms_norm_eps)

    return build


def _layer_norm(config: PretrainedConfig) -> nn.Module:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


def _gemma_embed_scale(config: PretrainedConfig) -> float:
    return float(config.hidden_size) ** 0.5


def _final_softcap(config: PretrainedConfig) -> float | None:
    return getattr(config, "final_logit_softcapping", None)


def _all_heads(config: PretrainedConfig) -> int:
    return int(config.num_attention_heads)


def _falcon_kv_heads(config: PretrainedConfig) -> int:
    if config.new_decoder_architecture:
        return int(config.num_kv_heads)
    return 1 if config.multi_query else int(config.num_attention_heads)


def _falcon_kv_broadcast(config: PretrainedConfig) -> int:
    # The new architecture hands the cache each key/value head repeated for its whole query group.
    if config.new_decoder_architecture:
        return int(config.num_attention_heads) // int(config.num_kv_heads)
    return 1


def _falcon_validate(config: PretrainedConfig) -> None:
    if config.alibi:
        raise ModelLoadError("Falcon checkpoints with ALiBi (falcon-rw) are not supported; rotary Falcon models are")


_TRANSFORMER = TensorLayout(
    blocks="transformer.h", embed="transformer.word_embeddings.weight", final_norm="transformer.ln_f"
)


def _llama(m: ModuleType) -> Family:
    return Family(
        "llama",
        m.LlamaDecoderLayer,
        m.LlamaRotaryEmbedding,
        _rms(m.LlamaRMSNorm),
        gguf_arch="llama",
        gguf_permutes_qk=True,
        sliding_window=_no_window,
        gguf_supported=True,
    )


def _mistral(m: ModuleType) -> Family:
    return Family(
        "mistral",
        m.MistralDecoderLayer,
        m.MistralRotaryEmbedding,
        _rms(m.MistralRMSNorm),
        gguf_arch="llama",  # llama.cpp converts Mistral checkpoints to its llama arch
        gguf_permutes_qk=True,
        sliding_window=_model_window,
        gguf_supported=True,
    )


def _qwen2(m: ModuleType) -> Family:
    return Family(
        "qwen2",
        m.Qwen2DecoderLayer,
        m.Qwen2RotaryEmbedding,
        _rms(m.Qwen2RMSNorm),
        gguf_arch="qwen2",
        gguf_permutes_qk=False,
        sliding_window=_per_layer_window,
        gguf_supported=True,
    )


def _qwen3(m: ModuleType) -> Family:
    return Family(
        "qwen3",
        m.Qwen3DecoderLayer,
        m.Qwen3RotaryEmbedding,
        _rms(m.Qwen3RMSNorm),
        gguf_arch="qwen3",
        gguf_permutes_qk=False,
        sliding_window=_per_layer_window,
        gguf_supported=True,
    )


def _mixtral(m: ModuleType) -> Family:
    return Family(
        "mixtral",
        m.MixtralDecoderLayer,
        m.MixtralRotaryEmbedding,
        _rms(m.MixtralRMSNorm),
        gguf_arch="llama",
        gguf_permutes_qk=True,
        sliding_window=_model_window,
        experts=ExpertLayout("block_sparse_moe", "w1", "w3", "w2", lambda c: int(c.num_local_experts)),
    )


def _qwen2_moe(m: ModuleType) -> Family:
    return Family(
        "qwen2_moe",
        m.Qwen2MoeDecoderLayer,
        m.Qwen2MoeRotaryEmbedding,
        _rms(m.Qwen2MoeRMSNorm),
        gguf_arch="qwen2moe",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_per_layer_window,
        experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj", lambda c: int(c.num_experts)),
    )


def _qwen3_moe(m: ModuleType) -> Family:
    return Family(
        "qwen3_moe",
        m.Qwen3MoeDecoderLayer,
        m.Qwen3MoeRotaryEmbedding,
        _rms(m.Qwen3MoeRMSNorm),
        gguf_arch="qwen3moe",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_model_window,
        experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj", lambda c: int(c.num_experts)),
    )


def _falcon(m: ModuleType) -> Family:
    return Family(
        "falcon",
        m.FalconDecoderLayer,
        m.FalconRotaryEmbedding,
        _layer_norm,
        gguf_arch="falcon",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_no_window,
        layout=_TRANSFORMER,
        layer_call="falcon",
        own_attention=True,
        kv_heads=_falcon_kv_heads,
        kv_broadcast=_falcon_kv_broadcast,
        validate=_falcon_validate,
        attn_implementation="sdpa",  # FalconDecoderLayer picks its attention class by this name
    )


def _bloom(m: ModuleType) -> Family:
    return Family(
        "bloom",
        m.BloomBlock,
        None,  # ALiBi: positions enter as a per-head bias on the attention scores
        _layer_norm,
        gguf_arch="bloom",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_no_window,
        layout=TensorLayout(
            blocks="transformer.h",
            embed="transformer.word_embeddings.weight",
            final_norm="transformer.ln_f",
            embed_norm="transformer.word_embeddings_layernorm",
        ),
        layer_call="bloom",
        own_attention=True,
        kv_heads=_all_heads,
    )


def _gemma2(m: ModuleType) -> Family:
    return Family(
        "gemma2",
        m.Gemma2DecoderLayer,
        m.Gemma2RotaryEmbedding,
        _rms(m.Gemma2RMSNorm),
        gguf_arch="gemma2",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_per_layer_window,
        embed_scale=_gemma_embed_scale,
        final_logit_softcap=_final_softcap,
    )


def _gemma3_text(m: ModuleType) -> Family:
    return Family(
        "gemma3_text",
        m.Gemma3DecoderLayer,
        m.Gemma3RotaryEmbedding,
        _rms(m.Gemma3RMSNorm),
        gguf_arch="gemma3",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_per_layer_window,
        layer_kind=_layer_type,
        embed_scale=_gemma_embed_scale,
        final_logit_softcap=_final_softcap,
    )


def _phi3(m: ModuleType) -> Family:
    return Family(
        "phi3",
        m.Phi3DecoderLayer,
        m.Phi3RotaryEmbedding,
        _rms(m.Phi3RMSNorm),
        gguf_arch="phi3",
        gguf_permutes_qk=False,
        sliding_window=_model_window,
        gguf_supported=True,
    )


# Each family's modeling module (transformers.models.PACKAGE.MODULE) and how to build it from that module.
_BUILDERS: dict[str, tuple[str, Callable[[ModuleType], Family]]] = {
    "llama": ("llama.modeling_llama", _llama),
    "mistral": ("mistral.modeling_mistral", _mistral),
    "qwen2": ("qwen2.modeling_qwen2", _qwen2),
    "qwen3": ("qwen3.modeling_qwen3", _qwen3),
    "mixtral": ("mixtral.modeling_mixtral", _mixtral),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe", _qwen2_moe),
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe", _qwen3_moe),
    "falcon": ("falcon.modeling_falcon", _falcon),
    "bloom": ("bloom.modeling_bloom", _bloom),
    "gemma2": ("gemma2.modeling_gemma2", _gemma2),
    "gemma3_text": ("gemma3.modeling_gemma3", _gemma3_text),
    "phi3": ("phi3.modeling_phi3", _phi3),
}
FAMILY_NAMES = tuple(sorted(_BUILDERS))


@functools.cache
def _family(name: str) -> Family:
    module_name, build = _BUILDERS[name]
    return build(importlib.import_module(f"transformers.models.{module_name}"))


def family_of(config: PretrainedConfig) -> Family:
    if config.model_type not in _BUILDERS:
        supported = ", ".join(FAMILY_NAMES)
        raise ModelLoadError(f"model type {config.model_type!r} is not supported (supported: {supported})")
    family = _family(config.model_type)
    family.validate(config)
    return family


def context_length(config: PretrainedConfig) -> int:
    """The longest sequence the model takes: its position table's length (ALiBi models: their training length)."""
    length = getattr(config, "max_position_embeddings", None) or getattr(config, "seq_length", None)
    return int(length or ALIBI_CONTEXT)
