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
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

NUM_LAYERS = 6
VOCAB = 128

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
    # No special tokens: generate() must never stop early on an EOS the random model happens to pick.
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

# Variant name -> config. Each family once; llama both untied and tied; Qwen2 keeps its q/k/v biases and gets
# sliding-window layers; Mistral gets a window shorter than the tests' sequences so the window is exercised.
TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False),
    "llama_tied": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=8, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=3, tie_word_embeddings=False
    ),
    "qwen3": lambda: Qwen3Config(**_COMMON, tie_word_embeddings=True),
}
TINY_VARIANTS = tuple(TINY_CONFIGS)


class TinyModel(NamedTuple):
    folder: Path  # a Hugging Face folder: config.json + safetensors
    model: PreTrainedModel  # the same weights in transformers, eval mode, float32


# What the ``tiny_model`` fixture hands a test: variant name -> its tiny model, built once per session.
GetTinyModel = Callable[[str], TinyModel]


def build_tiny(variant: str) -> PreTrainedModel:
    torch.manual_seed(TINY_VARIANTS.index(variant))
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[variant](), dtype=torch.float32)
    return model.eval()
