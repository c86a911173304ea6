"""Per-session KV storage for a span, and the ``Cache`` adapter transformers' decoder layers write through.

A session's keys and values live in tensors preallocated for its maximum length (the node's cache pool accounts for
exactly that room). One forward may carry several sessions at different lengths: the adapter writes each row's new
keys into its own session and hands the layer a right-padded view; the attention mask hides the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class SessionKV:
    """Keys/values of one session for blocks ``[first_block, first_block + num_layers)``.

    keys, values: [num_layers, kv_heads, max_length, head_dim]
    """

    def __init__(
        self,
        first_block: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, kv_heads, max_length, head_dim)
        self.first_block = first_block
        self.num_layers = num_layers
        self.max_length = max_length
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # tokens whose keys/values are stored

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.first_block + self.num_layers)


class BatchCache:
    """What a decoder layer sees as its ``cache`` for one forward over rows of several sessions.

    Row ``b`` holds ``new_tokens`` tokens at positions ``starts[b] ...``; a start below the session's length rewinds
    it (the tokens after it are overwritten), which is how a client replays or edits a suffix.
    """

    def __init__(self, sessions: Sequence[SessionKV], starts: Sequence[int], new_tokens: int) -> None:
        self.sessions = list(sessions)
        self.starts = list(starts)
        self.new_tokens = new_tokens
        self.total = max(starts) + new_tokens  # keys the widest row attends to

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, kv_heads, T, head_dim]
        end_offsets = [start + self.new_tokens for start in self.starts]
        for row, (session, start) in enumerate(zip(self.sessions, self.starts, strict=True)):
            layer = layer_idx - session.first_block
            session.keys[layer, :, start : start + self.new_tokens] = key_states[row]
            session.values[layer, :, start : start + self.new_tokens] = value_states[row]
        if len(self.sessions) == 1:
            session, layer = self.sessions[0], layer_idx - self.sessions[0].first_block
            return (
                session.keys[layer, :, : self.total].unsqueeze(0),
                session.values[layer, :, : self.total].unsqueeze(0),
            )
        batch, heads, _, head_dim = key_states.shape
        keys = key_states.new_zeros(batch, heads, self.total, head_dim)
        values = value_states.new_zeros(batch, heads, self.total, head_dim)
        for row, (session, end) in enumerate(zip(self.sessions, end_offsets, strict=True)):
            layer = layer_idx - session.first_block
            keys[row, :, :end] = session.keys[layer, :, :end]
            values[row, :, :end] = session.values[layer, :, :end]
        return keys, values

    def commit(self) -> None:
        """After the forward: every session now holds exactly the tokens up to its last written position."""
        for session, start in zip(self.sessions, self.starts, strict=True):
            session.length = start + self.new_tokens

    def attention_mask(self, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive mask [B, 1, T, total]: causal, per-row length, optional sliding window."""
        starts = torch.tensor(self.starts, device=device).view(-1, 1, 1, 1)
        query_pos = starts + torch.arange(self.new_tokens, device=device).view(1, 1, -1, 1)
        key_pos = torch.arange(self.total, device=device).view(1, 1, 1, -1)
        allowed = key_pos <= query_pos
        if window is not None:
            allowed &= query_pos - key_pos < window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)

    def position_ids(self, device: torch.device) -> torch.Tensor:
        """[B, T] absolute positions of the new tokens."""
        starts = torch.tensor(self.starts, device=device).view(-1, 1)
        return starts + torch.arange(self.new_tokens, device=device).view(1, -1)
