"""Supported model families: which transformers classes make up a block span and the gateway's head.

We drive transformers' own decoder-layer classes (so every family matches transformers exactly and follows its
releases) and give them our own KV cache and an explicit attention mask. A family is plain data (``Family``): the
classes to build, how its checkpoints and GGUF files name tensors, how its layers are called, and which layers use
sliding-window attention.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers import PretrainedConfig
from transformers.models.bloom import modeling_bloom
from transformers.models.falcon import modeling_falcon
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.mixtral import modeling_mixtral
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

from shared.errors import ModelLoadError
from shared.families.family import ExpertLayout, Family, TensorLayout

__all__ = ["FAMILIES", "ExpertLayout", "Family", "TensorLayout", "context_length", "family_of"]

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

FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama",
        modeling_llama.LlamaDecoderLayer,
        modeling_llama.LlamaRotaryEmbedding,
        _rms(modeling_llama.LlamaRMSNorm),
        gguf_arch="llama",
        gguf_permutes_qk=True,
        sliding_window=_no_window,
        gguf_supported=True,
    ),
    "mistral": Family(
        "mistral",
        modeling_mistral.MistralDecoderLayer,
        modeling_mistral.MistralRotaryEmbedding,
        _rms(modeling_mistral.MistralRMSNorm),
        gguf_arch="llama",  # llama.cpp converts Mistral checkpoints to its llama arch
        gguf_permutes_qk=True,
        sliding_window=_model_window,
        gguf_supported=True,
    ),
    "qwen2": Family(
        "qwen2",
        modeling_qwen2.Qwen2DecoderLayer,
        modeling_qwen2.Qwen2RotaryEmbedding,
        _rms(modeling_qwen2.Qwen2RMSNorm),
        gguf_arch="qwen2",
        gguf_permutes_qk=False,
        sliding_window=_per_layer_window,
        gguf_supported=True,
    ),
    "qwen3": Family(
        "qwen3",
        modeling_qwen3.Qwen3DecoderLayer,
        modeling_qwen3.Qwen3RotaryEmbedding,
        _rms(modeling_qwen3.Qwen3RMSNorm),
        gguf_arch="qwen3",
        gguf_permutes_qk=False,
        sliding_window=_per_layer_window,
        gguf_supported=True,
    ),
    "mixtral": Family(
        "mixtral",
        modeling_mixtral.MixtralDecoderLayer,
        modeling_mixtral.MixtralRotaryEmbedding,
        _rms(modeling_mixtral.MixtralRMSNorm),
        gguf_arch="llama",
        gguf_permutes_qk=True,
        sliding_window=_model_window,
        experts=ExpertLayout("block_sparse_moe", "w1", "w3", "w2", lambda c: int(c.num_local_experts)),
    ),
    "qwen2_moe": Family(
        "qwen2_moe",
        modeling_qwen2_moe.Qwen2MoeDecoderLayer,
        modeling_qwen2_moe.Qwen2MoeRotaryEmbedding,
        _rms(modeling_qwen2_moe.Qwen2MoeRMSNorm),
        gguf_arch="qwen2moe",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_per_layer_window,
        experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj", lambda c: int(c.num_experts)),
    ),
    "qwen3_moe": Family(
        "qwen3_moe",
        modeling_qwen3_moe.Qwen3MoeDecoderLayer,
        modeling_qwen3_moe.Qwen3MoeRotaryEmbedding,
        _rms(modeling_qwen3_moe.Qwen3MoeRMSNorm),
        gguf_arch="qwen3moe",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_model_window,
        experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj", lambda c: int(c.num_experts)),
    ),
    "falcon": Family(
        "falcon",
        modeling_falcon.FalconDecoderLayer,
        modeling_falcon.FalconRotaryEmbedding,
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
    ),
    "bloom": Family(
        "bloom",
        modeling_bloom.BloomBlock,
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
    ),
    "gemma2": Family(
        "gemma2",
        modeling_gemma2.Gemma2DecoderLayer,
        modeling_gemma2.Gemma2RotaryEmbedding,
        _rms(modeling_gemma2.Gemma2RMSNorm),
        gguf_arch="gemma2",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_per_layer_window,
        embed_scale=_gemma_embed_scale,
        final_logit_softcap=_final_softcap,
    ),
    "gemma3_text": Family(
        "gemma3_text",
        modeling_gemma3.Gemma3DecoderLayer,
        modeling_gemma3.Gemma3RotaryEmbedding,
        _rms(modeling_gemma3.Gemma3RMSNorm),
        gguf_arch="gemma3",
        gguf_permutes_qk=False,
        gguf_supported=True,
        sliding_window=_per_layer_window,
        layer_kind=_layer_type,
        embed_scale=_gemma_embed_scale,
        final_logit_softcap=_final_softcap,
    ),
    "phi3": Family(
        "phi3",
        modeling_phi3.Phi3DecoderLayer,
        modeling_phi3.Phi3RotaryEmbedding,
        _rms(modeling_phi3.Phi3RMSNorm),
        gguf_arch="phi3",
        gguf_permutes_qk=False,
        sliding_window=_model_window,
        gguf_supported=True,
    ),
}


def family_of(config: PretrainedConfig) -> Family:
    try:
        family = FAMILIES[config.model_type]
    except KeyError:
        supported = ", ".join(sorted(FAMILIES))
        raise ModelLoadError(f"model type {config.model_type!r} is not supported (supported: {supported})") from None
    family.validate(config)
    return family


def context_length(config: PretrainedConfig) -> int:
    """The longest sequence the model takes: its position table's length (ALiBi models: their training length)."""
    length = getattr(config, "max_position_embeddings", None) or getattr(config, "seq_length", None)
    return int(length or ALIBI_CONTEXT)
