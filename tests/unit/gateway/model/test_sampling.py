"""The sampler: bias, penalties and truncations agree with OpenAI's definitions and transformers' processors."""

from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from gateway.generation import SamplingParams
from gateway.model.sampling import Sampler, apply_logit_bias, apply_penalties, logits_to_probs, sample, top_logprobs

V = 32


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax_and_logit_bias_steers_it(logits: torch.Tensor) -> None:
    best = int(logits.argmax())
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, greedy, torch.Generator()) == best
    banned = SamplingParams(temperature=0.0, logit_bias=((best, -100.0),))
    assert Sampler(banned, V, []).next_token(logits) != best
    forced = SamplingParams(temperature=0.0, logit_bias=((7, 100.0),))
    assert Sampler(forced, V, []).next_token(logits) == 7
    assert torch.equal(apply_logit_bias(logits, SamplingParams()), logits)


def test_repetition_penalty_equals_transformers(logits: torch.Tensor) -> None:
    seen_ids = [1, 4, 4, 9, 30]
    seen = torch.zeros(V, dtype=torch.bool)
    seen[seen_ids] = True
    params = SamplingParams(repetition_penalty=1.3)
    ours = apply_penalties(logits, params, torch.zeros(V), seen)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen_ids]), logits[None].clone())[0]
    torch.testing.assert_close(ours, theirs)


def test_presence_and_frequency_penalties_follow_openai(logits: torch.Tensor) -> None:
    counts = torch.zeros(V)
    counts[3], counts[5] = 2, 1
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = apply_penalties(logits, params, counts, counts > 0)
    expected = logits.clone()
    expected[3] -= 0.5 + 2 * 0.25
    expected[5] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(ours, expected)


def test_penalties_count_generated_tokens() -> None:
    flat = torch.zeros(V)
    flat[2] = 1.0  # the favourite, until the frequency penalty makes it pay for each use
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.6), V, [])
    assert [sampler.next_token(flat.clone()) for _ in range(3)] == [2, 2, 0]
    assert sampler.output_counts[2] == 2 and sampler.output_counts[0] == 1


@pytest.mark.parametrize(
    ("params", "warper"),
    [
        (SamplingParams(top_k=5), TopKLogitsWarper(5)),
        (SamplingParams(top_p=0.7), TopPLogitsWarper(0.7)),
        (SamplingParams(min_p=0.1), MinPLogitsWarper(0.1)),
    ],
)
def test_truncations_keep_the_same_tokens_as_transformers(
    logits: torch.Tensor, params: SamplingParams, warper: object
) -> None:
    probs = logits_to_probs(logits, params)
    kept = warper(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0] > float("-inf")  # type: ignore[operator]
    assert torch.equal(probs > 0, kept)
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_temperature_scales_before_softmax(logits: torch.Tensor) -> None:
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.5)), torch.softmax(logits * 2, -1))


def test_same_seed_same_tokens_other_seed_other_tokens(logits: torch.Tensor) -> None:
    def run(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.5, seed=seed), V, [])
        return [sampler.next_token(logits) for _ in range(40)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_top_logprobs_are_the_most_likely_best_first(logits: torch.Tensor) -> None:
    logprobs = torch.log_softmax(logits, -1)
    top = top_logprobs(logprobs, 3)
    assert [token for token, _ in top] == logprobs.topk(3).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert top_logprobs(logprobs, 0) == ()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=5e-324),  # the API accepts any temperature in [0, 2]: the tiniest is greedy
        SamplingParams(temperature=9e-6),
        SamplingParams(temperature=2.0, top_p=5e-324),
        SamplingParams(min_p=1.0),
        SamplingParams(top_k=10**9),
        SamplingParams(repetition_penalty=0.01, presence_penalty=-2.0, frequency_penalty=2.0),
        SamplingParams(repetition_penalty=2.0, logit_bias=((0, 100.0), (1, -100.0))),
    ],
)
def test_extreme_parameters_the_api_accepts_sample_a_real_token(logits: torch.Tensor, params: SamplingParams) -> None:
    sampler = Sampler(params, V, [1, 2, 3])
    tokens = [sampler.next_token(logits) for _ in range(4)]
    assert all(0 <= token < V for token in tokens)
    if not params.greedy:
        assert torch.isfinite(logits_to_probs(logits, params)).all()
