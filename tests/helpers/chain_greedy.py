"""Greedy decoding through a swarm client's chain, step by step, with the gateway's head: what the churn and push
tests compare against an uninterrupted run."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from gateway.model.head import ModelHead
from gateway.swarm.chain_session import ChainSession


async def chain_greedy(head: ModelHead, chain: ChainSession, prompt: list[int], new_tokens: int) -> AsyncIterator[int]:
    """Yield ``new_tokens`` greedy tokens: the prompt as one step from position 0, then one token a step."""
    ids, position = prompt, 0
    for _ in range(new_tokens):
        output = await chain.step(head.embed(torch.tensor([ids])), position)
        token = int(head.logits(output[:, -1:])[0, -1].argmax())
        yield token
        position += len(ids)
        ids = [token]
