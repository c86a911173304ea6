"""Turning one position's logits into the next token, one small function per step (gpt-fast style).

    logits [V] ─bias, penalties→ [V] ─grammar mask→ [V] ─temperature, top-k, top-p, min-p→ probs [V] ─multinomial→ id

Greedy picks the argmax after bias and penalties (so ``logit_bias`` and penalties steer greedy decoding too, as in
OpenAI's API and transformers). Reported logprobs are the model's own distribution, before any of this (vLLM's
``raw_logprobs``): they say what the model thinks, not what the sampler was told to do. The grammar mask (constrained
decoding) comes before temperature and the cuts, so top-k/top-p choose among the tokens the grammar allows.
"""

from __future__ import annotations

import torch

from gateway.generation import SamplingParams
from gateway.model.grammar import Constraint

__all__ = ["Sampler", "SamplingParams", "logits_to_probs", "make_generator", "sample", "top_logprobs"]


def make_generator(params: SamplingParams) -> torch.Generator:
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] -> [V] with OpenAI's additive per-token bias."""
    if not params.logit_bias:
        return logits
    ids = torch.tensor([token for token, _ in params.logit_bias])
    bias = torch.tensor([value for _, value in params.logit_bias], dtype=logits.dtype)
    return logits.index_add(0, ids, bias)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, output_counts: torch.Tensor, seen: torch.Tensor
) -> torch.Tensor:
    """logits: [V]; output_counts: [V] occurrences in the generated tokens; seen: [V] bool, prompt or generated.

    OpenAI's presence/frequency penalties look at generated tokens only; transformers' repetition penalty at every
    token of the sequence, shrinking positive logits and growing negative ones.
    """
    if params.repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * output_counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (output_counts > 0).to(logits.dtype)
    return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [V] float32 -> probabilities [V] after temperature, top-k, top-p and min-p."""
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        outside[0] = False  # the most likely token always stays (a top_p that is 0 in float32 would drop it too)
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits: [V] (already biased and penalized) -> one token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = logits_to_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """logprobs: [V] -> the k most likely (token id, logprob), best first."""
    if k <= 0:
        return ()
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return tuple(zip(ids.tolist(), values.tolist(), strict=True))


class Sampler:
    """One sequence's sampling state: its seeded generator and the token counts its penalties need."""

    def __init__(
        self, params: SamplingParams, vocab_size: int, prompt_ids: list[int], constraint: Constraint | None = None
    ) -> None:
        self.params = params
        self.constraint = constraint  # the grammar the output must match, if any
        self.generator = make_generator(params)
        self.output_counts = torch.zeros(vocab_size)  # [V]
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        if prompt_ids:
            self.seen[torch.tensor(prompt_ids)] = True

    def next_token(self, logits: torch.Tensor) -> int:
        """logits: [V] float32 of the last position -> the next token id (and it is counted)."""
        logits = apply_logit_bias(logits, self.params)
        logits = apply_penalties(logits, self.params, self.output_counts, self.seen)
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        token = sample(logits, self.params, self.generator)
        if self.constraint is not None:
            self.constraint.advance(token)
        self.output_counts[token] += 1
        self.seen[token] = True
        return token
