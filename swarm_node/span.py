"""A span of decoder blocks ``[start, end)`` built from transformers' own layer classes, and its head counterpart.

The span runs prefill and incremental decode over ``SessionKV`` caches with explicit positions; a forward may use a
sub-range of the span's blocks (a client that needs only some of them, e.g. after a failover).

Attention goes through one function we register in transformers' attention-interface registry (a public API):
decode forwards (one new token per row, or rows of different lengths packed into one) attend row by row over each
session's own cache (``BatchCache.attend``), everything else is transformers' own SDPA attention with our explicit
mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from shared.block_tensors import read_block
from shared.errors import ModelLoadError
from shared.families import family_of
from shared.lora import LoraAdapter
from shared.weights import WeightReader
from swarm_node.adapters import AdapterRows, attach_adapters
from swarm_node.kv_cache import BatchCache, SessionKV, softcapped_attention
from swarm_node.layer_api import cache_keyword

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
    softcap = kwargs.pop("softcap", None)  # Gemma 2: tanh soft-capping of the attention scores
    if isinstance(ragged, BatchCache):
        return ragged.attend(cast(int, module.layer_idx), query, scaling, softcap), None
    if softcap is not None:
        return softcapped_attention(query, key, value, attention_mask, scaling, softcap), None
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    output, _ = sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return output, None


AttentionInterface.register(ATTENTION, _attention)


def prepare_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config our blocks are built with: our attention function, which takes explicit masks or ragged rows
    (families whose layers compute attention themselves get the implementation they choose their class by)."""
    config._attn_implementation = family_of(config).attn_implementation or ATTENTION
    if family_of(config).experts is not None:
        # transformers' own loop: rows grouped by expert, one matmul per expert the batch routes to.
        config._experts_implementation = "eager"
    return config


def head_dim_of(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def kv_bytes_per_token(config: PretrainedConfig, num_blocks: int, dtype: torch.dtype) -> int:
    """Bytes of keys + values one token occupies in a session over ``num_blocks`` blocks."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_blocks * family_of(config).kv_heads(config) * head_dim_of(config) * element


class BlockSpan(nn.Module):
    def __init__(self, config: PretrainedConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ModelLoadError(f"span {start}:{end} is outside the model's {config.num_hidden_layers} blocks")
        self.config = prepare_config(config)
        self.family = family_of(config)
        self.start, self.end = start, end
        # Read off the installed layer's signature before anything is built: a mismatch refuses to start.
        self.cache_keyword = cache_keyword(self.family.decoder_layer, self.family.layer_call)
        self.layers = nn.ModuleDict({str(i): self.family.decoder_layer(config, i) for i in range(start, end)})
        self.rotary = self._new_rotary()
        self._windows = {i: self.family.sliding_window(config, i) for i in range(start, end)}
        self._kinds = {i: self.family.layer_kind(config, i) for i in range(start, end)}
        # Set by build_span: where the span computes, and the dtype its activations and keys/values are kept in
        # (a quantized span's parameters are integers, so neither can be read off its parameters).
        self.device = torch.device("cpu")
        self.cache_dtype = torch.float32
        self.adapter_rows = AdapterRows()  # each row's adapter during a forward (swarm_node.adapters)
        self.adapters: frozenset[str] = frozenset()  # the LoRA adapters a session may name
        self.forget_kv = False  # testing only (--faulty-outputs stale-cache): drop each forward's keys/values

    def _new_rotary(self) -> nn.Module | None:
        rotary = self.family.rotary_embedding
        return None if rotary is None else rotary(config=self.config)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def new_session_kv(self, blocks: range, max_length: int, adapter: str | None = None) -> SessionKV:
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter {adapter!r} is not loaded on this span")
        return SessionKV(
            blocks.start,
            len(blocks),
            self.family.kv_heads(self.config),
            head_dim_of(self.config),
            max_length,
            dtype=self.cache_dtype,
            device=self.device,
            adapter=adapter,
        )

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        sessions: Sequence[SessionKV],
        starts: Sequence[int],
        blocks: range,
        lengths: Sequence[int] | None = None,
        parents: Sequence[int] | None = None,
        *,
        packed: bool = False,
    ) -> torch.Tensor:
        """hidden: [B, T, D] new tokens of B sessions, row b at positions starts[b]...; returns [B, T, D].

        ``lengths``: row b's real tokens are its first lengths[b] (right padding after them; default: all T).
        ``parents``: one row's T tokens are a tree (``BatchCache``): each token's parent, -1 for the last stored one.
        ``packed``: compute only the real tokens, every row's in turn in one row of the forward (a decode batch's
        rows of different lengths: the padding would cost a row's worth of compute per extra position); the
        padding's outputs are zeros. Families whose layers compute attention themselves run the padded layout."""
        ragged = not self.family.own_attention
        broadcast = self.family.kv_broadcast(self.config)
        pack = list(lengths) if packed and ragged and lengths is not None and hidden.shape[1] > 1 else None
        names = [session.adapter for session in sessions]
        rows, new_tokens = hidden.shape[:2]
        if pack is not None:
            names = [name for name, n in zip(names, pack, strict=True) for _ in range(n)]  # each token's adapter
            hidden = torch.cat([hidden[row, :n] for row, n in enumerate(pack)]).unsqueeze(0)
        cache = BatchCache(
            sessions, starts, new_tokens, self._windows, lengths, ragged, broadcast, parents, pack is not None
        )
        inputs = _LayerInputs(self, cache, hidden)
        self.adapter_rows.set(names, hidden.device)
        try:
            for block in blocks:
                hidden = inputs.call(self.layers[str(block)], block, hidden)
        finally:
            self.adapter_rows.clear()
        cache.check_written(blocks)  # a block that stored no keys/values would make every later step wrong
        cache.commit()
        if self.forget_kv:
            cache.forget()
        if pack is not None:
            output = hidden.new_zeros(rows, new_tokens, hidden.shape[2])
            for row, part in enumerate(hidden[0].split(pack)):
                output[row, : part.shape[0]] = part
            return output
        return hidden


class _LayerInputs:
    """What the layers of one forward take beside the hidden states, each built once and shared by the blocks."""

    def __init__(self, span: BlockSpan, cache: BatchCache, hidden: torch.Tensor) -> None:
        self.span, self.cache = span, cache
        self.dtype, self.device = hidden.dtype, hidden.device
        self.position_ids = cache.position_ids(hidden.device)  # [B, T]
        self._like = hidden
        self._masks: dict[int | None, torch.Tensor | None] = {}
        self._rotary: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self._alibi: torch.Tensor | None = None

    def mask(self, block: int) -> torch.Tensor | None:
        window = self.span._windows[block]
        if window not in self._masks:
            ragged = self.cache.ragged
            self._masks[window] = None if ragged else self.cache.attention_mask(window, self.dtype, self.device)
        return self._masks[window]

    def rotary(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for the block's kind of layer (Gemma 3's local and global layers use different bases)."""
        kind = self.span._kinds[block]
        if kind not in self._rotary:
            rotary = cast(nn.Module, self.span.rotary)
            args = (self._like, self.position_ids) if kind is None else (self._like, self.position_ids, kind)
            self._rotary[kind] = rotary(*args)
        return self._rotary[kind]

    def alibi(self) -> torch.Tensor:
        """BLOOM's ALiBi bias [B * heads, 1, total]: a per-head slope times each key's absolute position (a tree's
        keys: their tokens' depth positions, not their slots)."""
        if self._alibi is None:
            # Only BLOOM spans get here, and their family imported this module already (shared.families).
            from transformers.models.bloom.modeling_bloom import build_alibi_tensor

            heads = int(self.span.config.n_head)
            if self.cache.parents is None:
                keys = torch.ones(len(self.cache.sessions), self.cache.total, device=self.device)
                self._alibi = build_alibi_tensor(keys, heads, self.dtype)
            else:  # one row: the slopes (the bias at position 1) times each key's position
                slopes = build_alibi_tensor(torch.ones(1, 2, device=self.device), heads, self.dtype)
                positions = self.cache.key_positions(self.device).to(self.dtype)
                self._alibi = slopes[:, :, 1:] * positions.view(1, 1, -1)
        return self._alibi

    def call(self, layer: nn.Module, block: int, hidden: torch.Tensor) -> torch.Tensor:
        call = self.span.family.layer_call
        cache: dict[str, Any] = {self.span.cache_keyword: self.cache}  # the keyword the installed layer names
        if call == "bloom":
            out = layer(hidden, alibi=self.alibi(), attention_mask=self.mask(block), **cache)
        elif call == "falcon":
            out = layer(
                hidden,
                alibi=None,
                attention_mask=self.mask(block),
                position_ids=self.position_ids,
                use_cache=True,
                position_embeddings=self.rotary(block),
                **cache,
            )
        else:
            extra: dict[str, Any] = {RAGGED_KWARG: self.cache} if self.cache.ragged else {}
            out = layer(
                hidden,
                attention_mask=self.mask(block),
                position_ids=self.position_ids,
                use_cache=True,
                position_embeddings=self.rotary(block),
                **cache,
                **extra,
            )
        return cast(torch.Tensor, out[0] if isinstance(out, tuple) else out)


def build_span(
    config: PretrainedConfig,
    reader: WeightReader,
    start: int,
    end: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    transform: BlockTransform | None = None,
    adapters: Sequence[LoraAdapter] = (),
) -> BlockSpan:
    """Build the span's modules without allocating random weights, then fill them with exactly its tensors.

    Blocks are loaded one at a time (read, optionally transformed, moved to ``device``), so the peak memory of
    loading is one block in ``dtype`` beyond the finished span — a quantized span never exists unquantized whole.
    ``adapters``: LoRA pairs added on top of the (transformed) blocks' linears, kept in ``dtype``.
    """
    with torch.device("meta"):
        span = BlockSpan(config, start, end)
    rotary = span._new_rotary()
    span.rotary = None if rotary is None else rotary.to(device)
    span.device, span.cache_dtype = torch.device(device), dtype
    load_device = "cpu" if transform is not None else device
    for block in range(start, end):
        layer = span.layers[str(block)]
        tensors = read_block(config, reader, block, layer.state_dict())
        state = {local: tensor.to(dtype=dtype, device=load_device) for local, tensor in tensors.items()}
        layer.load_state_dict(state, strict=True, assign=True)
        if transform is not None:
            span.layers[str(block)] = transform(layer).to(device)
        prefix = span.family.layout.block_prefix(block)
        attach_adapters(span.layers[str(block)], prefix, adapters, span.adapter_rows, span.device, dtype)
    span.adapters = frozenset(adapter.name for adapter in adapters)
    return span.eval()
