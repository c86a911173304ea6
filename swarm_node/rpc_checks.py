"""Explicit checks of what an RPC brings, before any of it reaches the span: each failure a typed ``BadRequest``
(or the more specific error a client can act on), never an ``assert``."""

from __future__ import annotations

import torch

from shared.errors import BadRequest, PositionOutOfRange, ProtocolMismatch, WrongSpan
from shared.wire import PROTOCOL_VERSION, BatchStep, PushStep


def check_protocol(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolMismatch(f"client speaks protocol {version}, this node speaks {PROTOCOL_VERSION}")


def check_blocks(start: int, end: int, span: range) -> range:
    """The requested blocks, if they lie within the node's span."""
    if not span.start <= start < end <= span.stop:
        raise WrongSpan(f"blocks {start}:{end} are not within this node's span {span.start}:{span.stop}")
    return range(start, end)


def check_max_length(max_length: int, limit: int) -> None:
    if max_length > limit:
        raise PositionOutOfRange(f"max_length {max_length} exceeds this node's limit of {limit}")


def check_hidden(tensors: list[torch.Tensor], hidden_size: int, batch: int | None) -> torch.Tensor:
    """The one [batch, tokens, hidden_size] tensor of a step or forward, finite."""
    if len(tensors) != 1:
        raise BadRequest(f"expected one hidden-states tensor, got {len(tensors)}")
    (hidden,) = tensors
    if hidden.ndim != 3 or hidden.shape[1] == 0 or hidden.shape[0] == 0:
        raise BadRequest(f"hidden states must be [batch, tokens, {hidden_size}], got {list(hidden.shape)}")
    if batch is not None and hidden.shape[0] != batch:
        raise BadRequest(f"an inference step takes batch {batch}, got {hidden.shape[0]}")
    if hidden.shape[2] != hidden_size:
        raise BadRequest(f"hidden size {hidden.shape[2]} != the model's {hidden_size}")
    if not torch.isfinite(hidden).all():
        raise BadRequest("hidden states contain NaN or infinity")
    return hidden


def check_batch(message: BatchStep | PushStep, tensors: list[torch.Tensor], hidden_size: int) -> torch.Tensor:
    """The [B, T, D] hidden states of a batch step, T its longest row's tokens (each row is checked again with its
    own session)."""
    rows = len(message.rows)
    if len(tensors) != 1:
        raise BadRequest(f"expected one hidden-states tensor, got {len(tensors)}")
    shape = list(tensors[0].shape)
    width = max(row.tokens for row in message.rows)
    if shape != [rows, width, hidden_size]:
        raise BadRequest(
            f"a batch step of {rows} rows takes hidden states [{rows}, {width}, {hidden_size}], got {shape}"
        )
    if len({row.session_id for row in message.rows}) != rows:
        raise BadRequest("a batch step names a session twice")
    return tensors[0]
