"""A span of decoder blocks ``[start, end)`` built from transformers' own layer classes, and its head counterpart.

The span runs prefill and incremental decode over ``SessionKV`` caches with explicit positions; a forward may use a
sub-range of the span's blocks (a client that needs only some of them, e.g. after a failover).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from shared.errors import ModelLoadError
from shared.families import family_of
from shared.kv_cache import BatchCache, SessionKV
from shared.weights import WeightReader, block_prefix


def prepare_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config our blocks are built with: SDPA attention, which takes our explicit masks."""
    config._attn_implementation = "sdpa"
    return config


def head_dim_of(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


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

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def new_session_kv(self, blocks: range, max_length: int) -> SessionKV:
        param = next(self.parameters())
        return SessionKV(
            blocks.start,
            len(blocks),
            int(self.config.num_key_value_heads),
            head_dim_of(self.config),
            max_length,
            dtype=param.dtype if param.is_floating_point() else torch.float32,
            device=param.device,
        )

    @torch.inference_mode()
    def forward(
        self, hidden: torch.Tensor, sessions: Sequence[SessionKV], starts: Sequence[int], blocks: range
    ) -> torch.Tensor:
        """hidden: [B, T, D] new tokens of B sessions, row b at positions starts[b]...; returns [B, T, D]."""
        cache = BatchCache(sessions, starts, hidden.shape[1])
        position_ids = cache.position_ids(hidden.device)
        position_embeddings = self.rotary(hidden, position_ids)
        masks: dict[int | None, torch.Tensor] = {}
        for block in blocks:
            window = self._windows[block]
            if window not in masks:
                masks[window] = cache.attention_mask(window, hidden.dtype, hidden.device)
            hidden = self.layers[str(block)](
                hidden,
                attention_mask=masks[window],
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
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
) -> BlockSpan:
    """Build the span's modules without allocating random weights, then fill them with exactly its tensors."""
    with torch.device("meta"):
        span = BlockSpan(config, start, end)
    span.rotary = span.family.rotary_embedding(config=config).to(device)
    checkpoint_names = _span_checkpoint_names(span)
    tensors = reader.read(checkpoint_names.values())
    state = {local: tensors[remote].to(dtype=dtype, device=device) for local, remote in checkpoint_names.items()}
    span.layers.load_state_dict(state, strict=True, assign=True)
    return span.eval()


def _span_checkpoint_names(span: BlockSpan) -> dict[str, str]:
    """Local parameter name (``3.mlp.up_proj.weight``) -> checkpoint name (``model.layers.3.mlp.up_proj.weight``)."""
    names = {}
    for local in span.layers.state_dict():
        block, rest = local.split(".", 1)
        names[local] = f"{block_prefix(int(block))}{rest}"
    return names
