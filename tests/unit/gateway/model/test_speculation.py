"""Speculative decoding's pure parts: prompt lookup, the choice of k, and the per-generation estimates."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from gateway.generation import GenerationRequest
from gateway.model import speculation
from gateway.model.speculation import (
    EWMA,
    DecodePlan,
    PromptLookup,
    SpecTuner,
    choose_k,
    expected_tokens,
    propose_ngram,
)


def test_prompt_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    text = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" occurred at the start (followed by 4 5); "2 3" later too (followed by 7 8): the longer match wins
    assert propose_ngram(text, 3) == [4, 5, 9]
    assert propose_ngram([6, 2, 3, 7, 8, 0, 2, 3], 2) == [7, 8]
    assert propose_ngram([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # stops at the end of the text
    assert propose_ngram([1, 2, 3, 4], 3) == []  # the suffix never occurred before
    assert propose_ngram([5, 5], 3) == []  # one repeated token is not a match (min n = 2)
    assert propose_ngram([1, 2, 1, 2], 0) == []


def test_expected_tokens_per_round() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_no_drafts_on_loopback_and_more_drafts_the_further_and_the_more_they_are_accepted() -> None:
    assert choose_k(0.95, rtt=0.0005, compute=0.03, k_max=8, min_rtt=0.01) == 0  # loopback
    wan = choose_k(0.9, rtt=0.1, compute=0.03, k_max=8, min_rtt=0.01)
    assert 4 <= wan <= 8
    assert choose_k(0.5, rtt=0.1, compute=0.03, k_max=8, min_rtt=0.01) < wan
    assert choose_k(0.05, rtt=0.1, compute=0.03, k_max=8, min_rtt=0.01) == 0  # drafts that never pay
    # compute-bound (a long step, a short trip): extra positions cost more than the round trips they save
    assert choose_k(0.15, rtt=0.01, compute=1.0, k_max=8, min_rtt=0.01) == 0
    assert choose_k(0.15, rtt=0.2, compute=0.03, k_max=8, min_rtt=0.01) > 0
    assert choose_k(0.9, rtt=0.1, compute=0.03, k_max=2, min_rtt=0.01) == 2


def test_the_tuner_follows_acceptance_and_compute_and_respects_the_limit() -> None:
    tuner = SpecTuner(k_max=8, min_rtt=0.01)
    start = tuner.next_k(0.1, limit=100)
    for _ in range(10):
        tuner.record_round(drafted=5, accepted=5)
    assert tuner.acceptance > 0.95 and tuner.next_k(0.1, limit=100) >= start
    assert tuner.next_k(0.1, limit=2) == 2
    assert tuner.next_k(0.1, limit=-1) == 0
    for _ in range(10):
        tuner.record_round(drafted=5, accepted=0)
    assert tuner.acceptance < 0.05 and tuner.next_k(0.1, limit=100) == 0
    tuner.record_step(0.2, rtt=0.1)
    assert tuner.compute == pytest.approx(0.3 * 0.1)


def test_under_load_a_round_is_charged_for_the_rows_it_delays_not_switched_off() -> None:
    lookup = PromptLookup([1, 2, 3, 1, 2], SpecTuner(k_max=8, min_rtt=0.01, compute=0.03))
    plan = DecodePlan(GenerationRequest([1, 2, 3, 1, 2], 50), lookup)
    assert plan.next_k(0.1, others=7) > 0  # seven other generations decoding: the verify step rides with them
    assert plan.next_k(0.001, others=0) == 0  # loopback
    assert DecodePlan(GenerationRequest([1, 2], 50), None).next_k(0.1, others=0) == 0  # --speculative off
    # Seven other rows wait on the extra positions too, but each costs a fraction of a row's share of the batched
    # forward: given the forward's measured compute, the same drafts pay as alone ...
    alone = choose_k(0.6, rtt=0.1, compute=0.03, k_max=8, min_rtt=0.01)
    assert alone > 0 and choose_k(0.6, rtt=0.1, compute=0.03, k_max=8, min_rtt=0.01, batch_rows=7) == alone
    # ... and a heavier batch (a longer forward) drafts less; drafts that are often wrong stop paying
    assert 0 < choose_k(0.6, rtt=0.1, compute=0.2, k_max=8, min_rtt=0.01, batch_rows=7) < alone
    assert choose_k(0.25, rtt=0.05, compute=0.1, k_max=8, min_rtt=0.01, batch_rows=7) > 0
    assert choose_k(0.25, rtt=0.05, compute=0.4, k_max=8, min_rtt=0.01, batch_rows=7) == 0


def test_verify_steps_relayed_must_beat_decode_steps_pushed() -> None:
    # low acceptance: 1.3 tokens a round for 2 RTTs does not beat 1 token for 1.5 RTTs, though it beats 2 RTTs
    assert choose_k(0.25, rtt=0.1, compute=0.01, k_max=8, min_rtt=0.01) > 0
    assert choose_k(0.25, rtt=0.1, compute=0.01, k_max=8, min_rtt=0.01, plain_rtt=0.075) == 0
    assert choose_k(0.9, rtt=0.1, compute=0.01, k_max=8, min_rtt=0.01, plain_rtt=0.075) > 0


class SlowFirstRead(PromptLookup):
    """A drafter whose proposal takes 2 s of ``clock``, 1.8 of them reading the prompt (as a draft model's first)."""

    def __init__(self, clock: SimpleNamespace, tuner: SpecTuner) -> None:
        super().__init__([1, 2, 3], tuner)
        self.clock = clock

    def propose(self, k: int, after: Sequence[int] = (), forced: int = 0) -> list[int]:
        self.clock.now += 2.0
        self.unpriced = 1.8
        return [7] * k


def test_a_drafters_prompt_read_is_not_charged_per_drafted_token(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(speculation, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    tuner = SpecTuner(k_max=8, min_rtt=0.01, acceptance=0.9, compute=0.08)
    plan = DecodePlan(GenerationRequest([1, 2, 3], 50), SlowFirstRead(clock, tuner))
    assert plan.propose(4) == ([7, 7, 7, 7], 0)
    assert tuner.draft_cost == pytest.approx(EWMA * 0.2 / 4)  # 0.2 s of drafting for 4 tokens; the read is not
    assert plan.next_k(0.1, others=0) > 0  # charged 2 s / 4 a token, drafting would price itself out for good
