"""Per-session KV storage for a span, and the ``Cache`` adapter transformers' decoder layers write through.

A session's keys and values live in tensors preallocated for its maximum length (the node's cache pool accounts for
exactly that room). One forward may carry several sessions at different lengths, in one of two layouts:

* **ragged** (decode: every row brings one new token). Each row's new key/value is written into its own session and
  attention runs row by row over that session's stored keys (``attend``) — no padded copy of anyone's cache, no mask.
  This is the hot path of batched decode: its cost is what the attention itself must read, whatever the lengths.
* **padded** (prefill: T > 1). One row reads its session's keys as a view; several rows get a right-padded copy and
  the attention mask hides the padding. Prefill is compute-bound, so the copy is noise there. Rows may bring fewer
  real tokens than T (``lengths``: prompts of different lengths in one forward, right-padded): only the real ones
  are stored, and what the padding computes is discarded by the caller.

A padded forward of one session may carry a **tree** of tokens (``parents``: speculative branches verified in one
step). Every tree token is stored, provisionally, at its slot ``start + i``, but attends only to the tokens before
``start`` and to its own ancestors, at the position its depth gives (``start + depth``): the output of each token is
what a chain of its ancestors alone would give. ``SessionKV.keep_branch`` keeps one branch afterwards, its keys and
values moved to consecutive positions — exactly the cache a chain of that branch would have written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn import functional

from shared.errors import KVNotWritten


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
        adapter: str | None = None,
    ) -> None:
        shape = (num_layers, kv_heads, max_length, head_dim)
        self.adapter = adapter  # the LoRA adapter the session's rows run with (None: the base model)
        self.first_block = first_block
        self.num_layers = num_layers
        self.max_length = max_length
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # tokens whose keys/values are stored

    def resize(self, max_length: int) -> None:
        """Room for ``max_length`` tokens, the stored ones kept: new tensors (both sizes live during the copy)."""
        if max_length < self.length:
            raise ValueError(f"cannot shrink below the {self.length} stored tokens")
        shape = (self.num_layers, self.keys.shape[1], max_length, self.keys.shape[3])
        keys = self.keys.new_zeros(shape)
        values = self.values.new_zeros(shape)
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values, self.max_length = keys, values, max_length

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.first_block + self.num_layers)

    def keep_branch(self, start: int, slots: Sequence[int]) -> None:
        """The stored tokens at ``slots`` (ascending, each at or after its new position) become positions ``start``,
        ``start + 1``, ...: one branch of a tree step kept, the rest of it forgotten (``check_branch`` first)."""
        for offset, slot in enumerate(slots):
            if slot != start + offset:  # ascending slots never overwrite a slot still to be moved
                self.keys[:, :, start + offset] = self.keys[:, :, slot]
                self.values[:, :, start + offset] = self.values[:, :, slot]
        self.length = start + len(slots)


def check_branch(length: int, start: int, slots: Sequence[int]) -> str | None:
    """Why keeping ``slots`` as positions ``start``... of a session holding ``length`` tokens is refused, or None."""
    if start < 0:
        return f"a branch of {len(slots)} tokens cannot end at position {start + len(slots)}"
    previous = start - 1
    for offset, slot in enumerate(slots):
        if slot <= previous or slot < start + offset:
            return f"branch slots {list(slots)} are not ascending from position {start}"
        previous = slot
    if slots and slots[-1] >= length:
        return f"branch slot {slots[-1]} is past the session's {length} stored tokens"
    return None


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each token of a tree step (0: its parent is the last stored token, ``-1``); a parent comes before its
    children. Raises ValueError for a malformed tree."""
    depths: list[int] = []
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            raise ValueError(f"tree parent {parent} of token {index} is not -1 or an earlier token")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def is_chain(parents: Sequence[int]) -> bool:
    """Whether a tree is one chain, each token the previous one's child (a plain step)."""
    return all(parent == index - 1 for index, parent in enumerate(parents))


class BatchCache:
    """What a decoder layer sees as its ``cache`` for one forward over rows of several sessions.

    Row ``b`` holds ``new_tokens`` tokens at positions ``starts[b] ...``, of which the first ``lengths[b]`` are real
    (default: all); a start below the session's length rewinds it (the tokens after it are overwritten), which is
    how a client replays or edits a suffix. ``windows`` maps a block to its sliding-window size (None: full
    attention), for the ragged layout's own attention; ``ragged_decode`` False keeps decode in the padded layout;
    ``kv_broadcast``: the layers hand over each key/value head this many times (stored once, repeated on return).
    """

    def __init__(
        self,
        sessions: Sequence[SessionKV],
        starts: Sequence[int],
        new_tokens: int,
        windows: Mapping[int, int | None] | None = None,
        lengths: Sequence[int] | None = None,
        ragged_decode: bool = True,
        kv_broadcast: int = 1,
        parents: Sequence[int] | None = None,
    ) -> None:
        self.sessions = list(sessions)
        self.starts = list(starts)
        self.new_tokens = new_tokens
        self.lengths = list(lengths) if lengths is not None else [new_tokens] * len(self.sessions)
        if any(not 0 < length <= new_tokens for length in self.lengths):
            raise ValueError(f"row lengths {self.lengths} must be within 1..{new_tokens}")
        self.total = max(starts) + new_tokens  # keys the widest row attends to
        self.windows = dict(windows or {})
        # Layers that compute attention themselves (Falcon, BLOOM) never call ``attend``: they get the padded layout.
        self.ragged = ragged_decode and new_tokens == 1
        self.kv_broadcast = kv_broadcast
        # A tree step (one session): each token's parent, -1 for the last stored token (None: a chain)
        self.parents = None if parents is None or is_chain(parents) else list(parents)
        if self.parents is not None and (len(self.sessions) != 1 or len(self.parents) != new_tokens):
            raise ValueError(f"a tree of {len(self.parents)} tokens needs one row of as many, got {self.lengths}")
        self.depths = tree_depths(self.parents) if self.parents is not None else list(range(new_tokens))
        self.ragged = self.ragged and self.parents is None
        self.written: dict[int, int] = {}  # block -> positions its layer stored in this forward (check_written)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, kv_heads * kv_broadcast, T, head_dim]; one copy of each head is stored
        if self.kv_broadcast > 1:
            key_states, value_states = key_states[:, :: self.kv_broadcast], value_states[:, :: self.kv_broadcast]
        self.written[layer_idx] = self.written.get(layer_idx, 0) + key_states.shape[2]
        keys, values = self._store_and_read(key_states, value_states, layer_idx)
        if self.kv_broadcast > 1 and not self.ragged:
            keys = keys.repeat_interleave(self.kv_broadcast, dim=1)
            values = values.repeat_interleave(self.kv_broadcast, dim=1)
        return keys, values

    def _store_and_read(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for row, (session, start, length) in enumerate(zip(self.sessions, self.starts, self.lengths, strict=True)):
            layer = layer_idx - session.first_block
            session.keys[layer, :, start : start + length] = key_states[row, :, :length]
            session.values[layer, :, start : start + length] = value_states[row, :, :length]
        if self.ragged:
            return key_states, value_states  # unused: ``attend`` reads each session's own storage
        if len(self.sessions) == 1:
            session, layer = self.sessions[0], layer_idx - self.sessions[0].first_block
            return (
                session.keys[layer, :, : self.total].unsqueeze(0),
                session.values[layer, :, : self.total].unsqueeze(0),
            )
        return self._padded(layer_idx, key_states)

    def _padded(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded [B, kv_heads, total, head_dim] copies; zeros (finite) where the mask hides the padding."""
        batch, heads, _, head_dim = like.shape
        keys = like.new_zeros(batch, heads, self.total, head_dim)
        values = like.new_zeros(batch, heads, self.total, head_dim)
        for row, (session, start, length) in enumerate(zip(self.sessions, self.starts, self.lengths, strict=True)):
            layer, end = layer_idx - session.first_block, start + length
            keys[row, :, :end] = session.keys[layer, :, :end]
            values[row, :, :end] = session.values[layer, :, :end]
        return keys, values

    def attend(
        self, layer_idx: int, query: torch.Tensor, scaling: float | None, softcap: float | None = None
    ) -> torch.Tensor:
        """Ragged decode attention: query [B, heads, 1, head_dim] -> [B, 1, heads, head_dim] (the layer's layout).

        Row b attends to its own session's keys up to its new token (within the block's sliding window). Query heads
        are grouped by the key/value head they share (GQA), so one SDPA call per row reads each key once.
        """
        batch, heads, _, head_dim = query.shape
        window = self.windows.get(layer_idx)
        outputs = []
        for row, (session, start) in enumerate(zip(self.sessions, self.starts, strict=True)):
            layer, end = layer_idx - session.first_block, start + 1
            begin = max(0, end - window) if window is not None else 0
            keys = session.keys[layer, :, begin:end]  # [kv_heads, S, head_dim], a view
            values = session.values[layer, :, begin:end]
            grouped = query[row].reshape(keys.shape[0], heads // keys.shape[0], head_dim)  # [kv_heads, group, hd]
            if softcap is None:
                out = functional.scaled_dot_product_attention(
                    grouped.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scale=scaling
                )
            else:
                out = _softcapped(grouped, keys, values, None, _scale(scaling, head_dim), softcap)
            outputs.append(out.reshape(heads, head_dim))
        return torch.stack(outputs).view(batch, 1, heads, head_dim)

    def check_written(self, blocks: range) -> None:
        """After the layers ran: each block of ``blocks`` stored exactly this forward's new positions, once.

        A layer that was handed the cache under a keyword it does not name swallows it and stores nothing."""
        wrong = {block: self.written.get(block, 0) for block in blocks if self.written.get(block) != self.new_tokens}
        if wrong:
            raise KVNotWritten(
                f"blocks {sorted(wrong)} stored {sorted(set(wrong.values()))} positions of keys/values in a forward"
                f" of {self.new_tokens} (the installed transformers' layers ignored the cache we passed?)"
            )

    def forget(self) -> None:
        """Drop the keys/values this forward stored (``--faulty-outputs stale-cache``: later steps attend to zeros,
        as they did when transformers' layers swallowed the cache keyword)."""
        for session, start, length in zip(self.sessions, self.starts, self.lengths, strict=True):
            session.keys[:, :, start : start + length] = 0
            session.values[:, :, start : start + length] = 0

    def commit(self) -> None:
        """After the forward: every session now holds exactly the tokens up to its last written position."""
        for session, start, length in zip(self.sessions, self.starts, self.lengths, strict=True):
            session.length = start + length

    def attention_mask(self, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive mask [B, 1, T, total] for the padded layout: causal, per-row length, optional sliding window; a
        tree's tokens see the stored tokens and their own ancestors only."""
        starts = torch.tensor(self.starts, device=device).view(-1, 1, 1, 1)
        query_pos = starts + torch.tensor(self.depths, device=device).view(1, 1, -1, 1)
        key_pos = self.key_positions(device).view(1, 1, 1, -1)
        if self.parents is None:
            allowed = key_pos <= query_pos
        else:
            allowed = torch.cat([torch.ones(self.new_tokens, self.starts[0], dtype=torch.bool), self._ancestry()], 1)
            allowed = allowed.to(device).view(1, 1, self.new_tokens, self.total)
        if window is not None:
            allowed &= query_pos - key_pos < window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)

    def position_ids(self, device: torch.device) -> torch.Tensor:
        """[B, T] absolute positions of the new tokens (a tree's: its start plus each token's depth)."""
        starts = torch.tensor(self.starts, device=device).view(-1, 1)
        return starts + torch.tensor(self.depths, device=device).view(1, -1)

    def key_positions(self, device: torch.device) -> torch.Tensor:
        """[total] the position of each key slot the widest row reads (a tree's slots: their tokens' depths)."""
        if self.parents is None:
            return torch.arange(self.total, device=device)
        stored = torch.arange(self.starts[0], device=device)
        return torch.cat([stored, self.starts[0] + torch.tensor(self.depths, device=device)])

    def _ancestry(self) -> torch.Tensor:
        """[T, T] bool: token i may attend to tree token j (j is i or one of its ancestors)."""
        assert self.parents is not None
        allowed = torch.eye(self.new_tokens, dtype=torch.bool)
        for index, parent in enumerate(self.parents):
            if parent >= 0:
                allowed[index] |= allowed[parent]
        return allowed


def _scale(scaling: float | None, head_dim: int) -> float:
    return float(head_dim) ** -0.5 if scaling is None else scaling


def _softcapped(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
) -> torch.Tensor:
    """Attention whose scores are soft-capped (``cap * tanh(score / cap)``) before the mask and the softmax.

    query [..., Q, hd] against keys/values [..., S, hd] with matching leading dims; mask broadcasts to [..., Q, S]."""
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    weights = functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """The padded layout's soft-capped attention (SDPA has no soft-capping): query [B, H, T, hd], key/value
    [B, kv_heads, S, hd], additive mask [B, 1, T, S] -> [B, T, H, hd] (the layout transformers' layers take)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = _softcapped(query, key, value, mask, _scale(scaling, query.shape[-1]), softcap)
    return out.transpose(1, 2).contiguous()
