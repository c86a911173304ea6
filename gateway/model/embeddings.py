"""Embeddings through the swarm: a prefill through the chain, the final norm, pooling and L2 norm at the gateway.

    token ids ─embed→ [1, T, D] ─chain (a session of its own, closed at once)→ last block's output ─final norm→
    [T, D] ─pool (last token | mean)→ [D] ─L2 normalize→ the vector

Pooling: every family the swarm serves (``shared.families``) is a decoder-only causal model, in which only the last
position has attended to the whole input, so its normed final hidden state is the one summary of the text a mean
cannot improve on (a mean over a causal model's positions weighs the first tokens, which saw little, as much as the
last). That is what embedding models trained from decoder LLMs do (E5-Mistral, GTE-Qwen, SFR use last-token
pooling); ``--embedding-pooling mean`` serves checkpoints trained with mean pooling instead. Vectors are L2-normalized
so that a dot product is the cosine similarity (what OpenAI's embeddings promise).

Each input is its own node session: sessions opened together reach each node's prefill batcher together and run as
one padded forward, with any generation's prompt that arrives meanwhile (``swarm_node/prefill_batcher.py``). A chain
is closed as soon as its output is back, so no node holds an embedding's KV cache after the call returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

Pooling = Literal["last", "mean"]

# Inputs of one request prefilled at once: enough to fill a node's prefill batch, few enough that a long list does not
# take every node's cache room from generations at once.
MAX_PARALLEL_INPUTS = 16

Prefill = Callable[[Sequence[int], str | None], Awaitable[torch.Tensor]]


def pooling_for(config: PretrainedConfig, configured: str = "auto") -> Pooling:
    """``configured`` when the operator chose; else last-token pooling, right for every (causal) family we serve."""
    if configured in ("last", "mean"):
        return configured  # type: ignore[return-value]  # one of the two literals, checked just above
    del config  # every family in shared.families is causal; a bidirectional one would pool "mean" here
    return "last"


@torch.inference_mode()
def pooled(output: torch.Tensor, norm: nn.Module, pooling: Pooling) -> list[float]:
    """output: the last block's [1, T, D] -> the final norm, pooled over T, L2-normalized, as float32 values."""
    normed = norm(output.float())[0]  # [T, D]
    vector = normed[-1] if pooling == "last" else normed.mean(dim=0)
    return [float(x) for x in torch.nn.functional.normalize(vector.float(), dim=0)]


async def embed_inputs(
    prefill: Prefill, inputs: Sequence[Sequence[int]], norm: nn.Module, pooling: Pooling, adapter: str | None
) -> list[list[float]]:
    """One vector per input, in order; the inputs' prefills run concurrently (``MAX_PARALLEL_INPUTS`` at a time).

    A failing input cancels the others (a TaskGroup): each closes its chain as it stops."""
    limit = asyncio.Semaphore(MAX_PARALLEL_INPUTS)

    async def one(token_ids: Sequence[int]) -> list[float]:
        async with limit:
            output = await prefill(token_ids, adapter)
        return await asyncio.to_thread(pooled, output, norm, pooling)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(token_ids)) for token_ids in inputs]
    except BaseExceptionGroup as failed:  # the first input's own error, typed, for the HTTP edge to answer
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]
