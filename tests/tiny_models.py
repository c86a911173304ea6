"""Tiny random models of every supported family: their configs, and how tests receive them.

Tiny models are built by transformers itself (``from_config``, seeded, float32) and saved with ``save_pretrained``
(see ``conftest.py``), so our loaders read exactly the files a hub checkpoint has; the transformers model stays in
memory as the reference our spans must match.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

NUM_LAYERS = 6
VOCAB = 128

# No special tokens: generate() must never stop early on an EOS the random model happens to pick.
_NO_SPECIAL_TOKENS: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    # Larger than the default 0.02 so greedy tokens of a random model vary instead of repeating one token.
    "initializer_range": 0.1,
    **_NO_SPECIAL_TOKENS,
}

# Mixture of experts: 4 experts, 2 per token, so a batch of a few rows already spreads over several experts.
_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

# Falcon and BLOOM configs name their sizes differently (no GQA, no head_dim, no intermediate size).
_FALCON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    "alibi": False,
    **_NO_SPECIAL_TOKENS,
}


def _gemma(config: type[PretrainedConfig], **extra: Any) -> PretrainedConfig:
    # Alternating sliding (window 5, shorter than the tests' sequences) and global layers, as Gemma 2 interleaves.
    layer_types = ["sliding_attention", "full_attention"] * (NUM_LAYERS // 2)
    return config(**_COMMON, sliding_window=5, layer_types=layer_types, tie_word_embeddings=True, **extra)


# Variant name -> config. Each family once; llama both untied and tied; Qwen2 keeps its q/k/v biases and gets
# sliding-window layers; Mistral gets a window shorter than the tests' sequences so the window is exercised; Falcon
# in both decoder architectures; Gemma 2 with its default soft-capping (attention 50, logits 30) made tighter so
# the tanh bends the random scores; Gemma 3 with its different local rotary base.
TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False),
    "llama_tied": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=8, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=3, tie_word_embeddings=False
    ),
    "qwen3": lambda: Qwen3Config(**_COMMON, tie_word_embeddings=True),
    "mixtral": lambda: MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **_COMMON, **_MOE, num_experts=4, shared_expert_intermediate_size=64, tie_word_embeddings=False
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_COMMON, **_MOE, num_experts=4, tie_word_embeddings=False),
    "falcon": lambda: FalconConfig(
        **_FALCON, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False
    ),
    "falcon_new": lambda: FalconConfig(
        **_FALCON, new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True, bias=False
    ),
    "bloom": lambda: BloomConfig(
        vocab_size=VOCAB, hidden_size=64, n_layer=NUM_LAYERS, n_head=4, initializer_range=0.1, **_NO_SPECIAL_TOKENS
    ),
    "gemma2": lambda: _gemma(Gemma2Config, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3": lambda: _gemma(Gemma3TextConfig, rope_local_base_freq=100.0),
    "phi3": lambda: Phi3Config(**{k: v for k, v in _COMMON.items() if k != "head_dim"}, tie_word_embeddings=False),
}
TINY_VARIANTS = tuple(TINY_CONFIGS)


class TinyModel(NamedTuple):
    folder: Path  # a Hugging Face folder: config.json + safetensors
    model: PreTrainedModel  # the same weights in transformers, eval mode, float32


# What the ``tiny_model`` fixture hands a test: variant name -> its tiny model, built once per session.
GetTinyModel = Callable[[str], TinyModel]


def build_tiny(variant: str) -> PreTrainedModel:
    torch.manual_seed(TINY_VARIANTS.index(variant))
    config = TINY_CONFIGS[variant]()
    # Soft-capped attention (Gemma 2) is only right in eager attention: transformers before 5.24 default it to SDPA,
    # which drops the capping, so the reference the span is checked against would be the wrong one.
    eager = getattr(config, "attn_logit_softcapping", None) is not None
    attention = "eager" if eager else None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    return model.eval()
