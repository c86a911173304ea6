"""A span of decoder blocks ``[start, end)`` built from transformers' own layer classes, and its head counterpart.

The span runs prefill and incremental decode over ``SessionKV`` caches with explicit positions; a forward may use a
sub-range of the span's blocks (a client that needs only some of them, e.g. after a failover).

Attention goes through one function we register in transformers' attention-interface registry (a public API):
decode forwards (one new token per row) attend row by row over each session's own cache (``BatchCache.attend``),
everything else is transformers' own SDPA attention with our explicit mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from shared.errors import ModelLoadError
from shared.families import family_of
from shared.weights import WeightReader, block_prefix
from swarm_node.kv_cache import BatchCache, SessionKV

ATTENTION = "swarmgate"
RAGGED_KWARG = "swarmgate_ragged"  # carries the BatchCache from our forward, through the layer, to ``_attention``

# Called on each block once its weights are loaded (on the CPU, in the span's dtype); returns the module to keep.
# The node uses it to swap linear layers for quantized ones; the block is moved to the span's device afterwards.
BlockTransform = Callable[[nn.Module], nn.Module]


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    ragged = kwargs.pop(RAGGED_KWARG, None)
    if isinstance(ragged, BatchCache):
        return ragged.attend(cast(int, module.layer_idx), query, scaling), None
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    output, _ = sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return output, None


AttentionInterface.register(ATTENTION, _attention)


def prepare_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config our blocks are built with: our attention function, which takes explicit masks or ragged rows."""
    config._attn_implementation = ATTENTION
    return config


def head_dim_of(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def kv_bytes_per_token(config: PretrainedConfig, num_blocks: int, dtype: torch.dtype) -> int:
    """Bytes of keys + values one token occupies in a session over ``num_blocks`` blocks."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_blocks * int(config.num_key_value_heads) * head_dim_of(config) * element


class BlockSpan(nn.Module):
    def __init__(self, config: PretrainedConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ModelLoadError(f"span {start}:{end} is outside the model's {config.num_hidden_layers} blocks")
        self.config = prepare_config(config)
        self.family = family_of(config)
        self.start, self.end = start, end
        self.layers = nn.ModuleDict({str(i): self.family.decoder_layer(config, i) for i in range(start, end)})
        self.rotary = self.family.rotary_embedding(config=config)
        self._windows = {i: self.family.sliding_window(config, i) for i in range(start, end)}
        # Set by build_span: where the span computes, and the dtype its activations and keys/values are kept in
        # (a quantized span's parameters are integers, so neither can be read off its parameters).
        self.device = torch.device("cpu")
        self.cache_dtype = torch.float32

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def new_session_kv(self, blocks: range, max_length: int) -> SessionKV:
        return SessionKV(
            blocks.start,
            len(blocks),
            int(self.config.num_key_value_heads),
            head_dim_of(self.config),
            max_length,
            dtype=self.cache_dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        sessions: Sequence[SessionKV],
        starts: Sequence[int],
        blocks: range,
        lengths: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """hidden: [B, T, D] new tokens of B sessions, row b at positions starts[b]...; returns [B, T, D].

        ``lengths``: row b's real tokens are its first lengths[b] (right padding after them; default: all T)."""
        cache = BatchCache(sessions, starts, hidden.shape[1], self._windows, lengths)
        position_ids = cache.position_ids(hidden.device)
        position_embeddings = self.rotary(hidden, position_ids)
        masks: dict[int | None, torch.Tensor | None] = {}
        extra: dict[str, Any] = {RAGGED_KWARG: cache} if cache.ragged else {}
        for block in blocks:
            window = self._windows[block]
            if window not in masks:
                masks[window] = None if cache.ragged else cache.attention_mask(window, hidden.dtype, hidden.device)
            hidden = self.layers[str(block)](
                hidden,
                attention_mask=masks[window],
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
                **extra,
            )
        cache.commit()
        return hidden


def build_span(
    config: PretrainedConfig,
    reader: WeightReader,
    start: int,
    end: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    transform: BlockTransform | None = None,
) -> BlockSpan:
    """Build the span's modules without allocating random weights, then fill them with exactly its tensors.

    Blocks are loaded one at a time (read, optionally transformed, moved to ``device``), so the peak memory of
    loading is one block in ``dtype`` beyond the finished span — a quantized span never exists unquantized whole.
    """
    with torch.device("meta"):
        span = BlockSpan(config, start, end)
    span.rotary = span.family.rotary_embedding(config=config).to(device)
    span.device, span.cache_dtype = torch.device(device), dtype
    load_device = "cpu" if transform is not None else device
    for block in range(start, end):
        names = {local: f"{block_prefix(block)}{local}" for local in span.layers[str(block)].state_dict()}
        tensors = reader.read(names.values())
        state = {local: tensors[remote].to(dtype=dtype, device=load_device) for local, remote in names.items()}
        layer = span.layers[str(block)]
        layer.load_state_dict(state, strict=True, assign=True)
        if transform is not None:
            span.layers[str(block)] = transform(layer).to(device)
    return span.eval()
