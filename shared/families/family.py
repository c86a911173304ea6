"""What a family is, as plain data: the transformers classes to build, how its checkpoints name tensors, how its
decoder layers are called, and what of the model lives on the gateway (embedding scale / norm, logit soft-capping).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

# How a decoder layer takes its inputs: "standard" (Llama and most since: position_embeddings, cache=), "falcon"
# (alibi, layer_past=, returns a tuple), "bloom" (alibi always, no rotary, layer_past=, returns a tuple).
LayerCall = Literal["standard", "falcon", "bloom"]

ConfigValue = Callable[[PretrainedConfig], float | None]


def _none(config: PretrainedConfig) -> None:
    return None


def _num_key_value_heads(config: PretrainedConfig) -> int:
    return int(config.num_key_value_heads)


def _no_broadcast(config: PretrainedConfig) -> int:
    return 1


def _no_layer_kind(config: PretrainedConfig, layer_idx: int) -> None:
    return None


@dataclass(frozen=True)
class TensorLayout:
    """Checkpoint tensor names outside the blocks, and the prefix of block ``i``'s tensors."""

    blocks: str = "model.layers"
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm"  # a module prefix: ``.weight`` (and ``.bias`` for a LayerNorm) follow
    embed_norm: str | None = None  # BLOOM normalizes the embeddings before the first block
    lm_head: str = "lm_head.weight"

    def block_prefix(self, block: int) -> str:
        return f"{self.blocks}.{block}."


@dataclass(frozen=True)
class ExpertLayout:
    """How checkpoints store the experts that transformers 5 keeps fused in the block.

    transformers holds ``mlp.experts.gate_up_proj`` [E, 2I, D] (gate rows, then up rows, per expert) and
    ``mlp.experts.down_proj`` [E, D, I]; hub checkpoints keep one linear per expert, e.g. Mixtral's
    ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down).
    """

    module: str  # the MoE module's name in the checkpoint (transformers calls it ``mlp``)
    gate: str
    up: str
    down: str
    num_experts: Callable[[PretrainedConfig], int]


@dataclass(frozen=True)
class Family:
    """One supported architecture.

    ``gguf_arch`` is the ``general.architecture`` name llama.cpp writes; ``gguf_permutes_qk`` says whether its
    converter permuted the Q/K projection rows (llama.cpp does this for the llama arch only, to suit its RoPE layout).
    ``own_attention``: the layers compute attention themselves (Falcon, BLOOM) instead of through transformers'
    attention-interface registry, so every forward uses the padded layout with an explicit mask.
    ``layer_kind``: the key a layer's rotary embedding is computed for (Gemma 3: local and global layers differ).
    ``kv_heads``: key/value heads the cache stores per token; ``kv_broadcast``: how many copies of each the layers
    hand the cache (Falcon's new architecture broadcasts every key/value head to its query group before caching:
    we store one copy and broadcast again on the way out, so its cache is not ``heads / kv_heads`` times larger).
    """

    name: str
    decoder_layer: type[nn.Module]
    rotary_embedding: type[nn.Module] | None
    final_norm: Callable[[PretrainedConfig], nn.Module]
    gguf_arch: str
    gguf_permutes_qk: bool
    sliding_window: Callable[[PretrainedConfig, int], int | None]
    layout: TensorLayout = field(default_factory=TensorLayout)
    layer_call: LayerCall = "standard"
    own_attention: bool = False
    layer_kind: Callable[[PretrainedConfig, int], str | None] = _no_layer_kind
    kv_heads: Callable[[PretrainedConfig], int] = _num_key_value_heads
    kv_broadcast: Callable[[PretrainedConfig], int] = _no_broadcast
    embed_scale: ConfigValue = _none
    final_logit_softcap: ConfigValue = _none
    experts: ExpertLayout | None = None
    # Checks a config for variants of the family we do not serve (raises ModelLoadError).
    validate: Callable[[PretrainedConfig], None] = _none
    # Whether our GGUF reader serves this family's files (tested against transformers' own GGUF load). llama.cpp
    # rewrites some families' tensors; the reader undoes what transformers undoes (shared/gguf_rewrites.py: Gemma's
    # norms + 1, BLOOM's q/k/v order). Families whose files it cannot read right are refused rather than served wrong.
    gguf_supported: bool = False
    # Config attributes the span sets before building layers (e.g. the attention implementation Falcon picks by).
    attn_implementation: str | None = None

    def block_parameters(self, config: PretrainedConfig, block: int) -> list[str]:
        """Names of block ``block``'s parameters as transformers builds it (on the meta device: nothing allocated)."""
        config = copy.copy(config)
        if self.attn_implementation is not None:
            config._attn_implementation = self.attn_implementation
        with torch.device("meta"):
            return list(self.decoder_layer(config, block).state_dict())
