"""What llama.cpp's converter rewrites in some families' tensors, undone as transformers' own GGUF loader undoes it.

* Gemma 2 / Gemma 3 store every RMSNorm weight plus one (their norms scale by ``1 + w``; llama.cpp's by ``w``).
* Qwen2-MoE stores the shared expert's gate [1, D] as a vector [D].
* BLOOM stores its fused ``query_key_value`` rows as all queries, then all keys, then all values, where the
  checkpoint interleaves them per head (``[head, q|k|v, head_dim]``); the bias likewise.

Falcon files are read only in Falcon 7B's shape (one key/value head): llama.cpp regroups the new architecture's
q/k/v rows, which transformers does not undo (its GGUF config has no ``new_decoder_architecture`` either).

Each rewrite takes the GGUF tensor name and the dequantized array in the checkpoint's (row-major) shape.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from transformers import PretrainedConfig

from shared.errors import ModelLoadError

Rewrite = Callable[[str, np.ndarray, PretrainedConfig], np.ndarray]


def _gemma_norms(gguf_name: str, weights: np.ndarray, config: PretrainedConfig) -> np.ndarray:
    return weights - 1 if "norm.weight" in gguf_name else weights


def _bloom_qkv(gguf_name: str, weights: np.ndarray, config: PretrainedConfig) -> np.ndarray:
    if "attn_qkv" not in gguf_name:
        return weights
    heads = int(config.n_head)
    hidden = int(config.hidden_size)
    rest = weights.shape[1:]  # (D,) for the weight, () for the bias
    q, k, v = (part.reshape(heads, hidden // heads, *rest) for part in np.split(weights, 3, axis=0))
    return np.stack([q, k, v], axis=1).reshape(weights.shape)


def _shared_expert_gate(gguf_name: str, weights: np.ndarray, config: PretrainedConfig) -> np.ndarray:
    return weights[None] if "ffn_gate_inp_shexp" in gguf_name and weights.ndim == 1 else weights


REWRITES: dict[str, Rewrite] = {
    "qwen2_moe": _shared_expert_gate,
    "gemma2": _gemma_norms,
    "gemma3_text": _gemma_norms,
    "bloom": _bloom_qkv,
}


def _falcon_multi_query_only(config: PretrainedConfig, kv_heads: int | None) -> None:
    """``kv_heads``: the file's ``attention.head_count_kv`` (transformers' Falcon config does not take it)."""
    if config.new_decoder_architecture or not config.multi_query or (kv_heads or 1) > 1:
        raise ModelLoadError(
            "GGUF files of Falcon's new decoder architecture (several key/value heads) are not supported; use its"
            " safetensors"
        )


# Per family: raises ModelLoadError for files the reader cannot serve right (given the file's key/value head count).
CHECKS: dict[str, Callable[[PretrainedConfig, int | None], None]] = {"falcon": _falcon_multi_query_only}
