"""The speculation tuner's decisions over many rounds: a priced-out drafter is re-probed (within a bound, at a bounded
cost), and the ``min_rtt`` gate does not flip with a round trip that jitters around it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from gateway.model.spec_tuner import (
    GATE_OFF,
    PROBE_BUDGET,
    PROBE_EVERY,
    SpecTuner,
    pipeline_break_even,
    pipelining_pays,
)

RTT = 0.075  # a pushed round trip behind 50 ms links, seconds
COMPUTE = 0.1  # the chain's compute per step on these CPUs


def decode(tuner: SpecTuner, rounds: int, draft_cost: Callable[[int], float], kept: Callable[[int], bool]) -> list[int]:
    """``rounds`` rounds as the decode loop runs them: k from the tuner, k drafts costing ``draft_cost(round)`` each,
    all kept or all rejected (``kept(round)``), the step's time measured -> k per round."""
    chosen: list[int] = []
    for round_ in range(rounds):
        k = tuner.next_k(RTT, limit=10_000)
        if k > 0:
            tuner.record_draft(k * draft_cost(round_), k)
            tuner.record_round(k, k if kept(round_) else 0)
        tuner.record_step(RTT + COMPUTE, RTT)
        chosen.append(k)
    return chosen


def first_drafting(chosen: list[int], start: int) -> int:
    return next(round_ for round_ in range(start, len(chosen)) if chosen[round_] > 0)


def test_a_tuner_that_priced_a_slow_draft_model_out_drafts_again_soon_after_its_cost_falls() -> None:
    tuner = SpecTuner(k_max=8, min_rtt=0.01, acceptance=0.9, compute=COMPUTE)
    # 0.15 s a drafted token (a same-size draft under load) for 40 rounds, then 0.01 s (the load went away)
    chosen = decode(tuner, 200, lambda round_: 0.15 if round_ < 40 else 0.01, lambda _: True)
    assert chosen[10:30] == [0] * 20  # priced out: the traversal a draft saves costs less than drafting it
    resumed = first_drafting(chosen, 40)
    # one probe's worth of budget: (0.15 s + a position's compute) / (3 % of a 0.175 s plain round), ~33 rounds
    assert resumed < 40 + 50
    assert all(k > 0 for k in chosen[resumed + 1 :])  # the cheap cost measured, it keeps drafting


def test_a_tuner_that_keeps_seeing_a_slow_draft_model_stays_mostly_at_k_0() -> None:
    tuner = SpecTuner(k_max=8, min_rtt=0.01, acceptance=0.9, compute=COMPUTE)
    chosen = decode(tuner, 1000, lambda _: 0.15, lambda _: True)
    settled = chosen[20:]
    probes = [k for k in settled if k > 0]
    assert probes and all(k == 1 for k in probes)  # it does re-measure, one draft at a time
    spent = 0.15 * len(probes)  # drafting time the probes took
    assert spent <= 1.2 * PROBE_BUDGET * len(settled) * (RTT + COMPUTE)  # about the budget of the plain rounds


def test_rejected_drafts_are_probed_again_and_drafting_resumes_when_the_text_starts_repeating() -> None:
    tuner = SpecTuner(k_max=8, min_rtt=0.01, compute=0.03)  # prompt lookup: drafting costs nothing
    chosen = decode(tuner, 200, lambda _: 0.0, lambda round_: round_ >= 60)
    probes = sum(k > 0 for k in chosen[20:60])  # every draft rejected: one round in PROBE_EVERY at most
    assert 0 < probes <= 40 // PROBE_EVERY
    resumed = first_drafting(chosen, 60)
    assert resumed < 60 + 4 * PROBE_EVERY  # a few probes' kept drafts turn the acceptance estimate
    assert all(k > 0 for k in chosen[resumed + 3 * PROBE_EVERY :])


def test_a_probe_after_a_long_gap_replaces_the_stale_draft_cost() -> None:
    tuner = SpecTuner(k_max=8, min_rtt=0.01, acceptance=0.9, compute=COMPUTE, draft_cost=0.15)
    for _ in range(30):  # rounds that drafted nothing: the estimate aged
        tuner.next_k(RTT, limit=100)
    tuner.record_draft(0.01, 1)
    assert tuner.draft_cost < 0.02
    tuner.next_k(RTT, limit=100)
    tuner.record_draft(0.15, 1)  # the next round's measurement is one EWMA step, as always
    assert 0.03 < tuner.draft_cost < 0.1


def test_a_round_trip_jittering_around_min_rtt_does_not_switch_drafting_every_round() -> None:
    tuner = SpecTuner(k_max=8, min_rtt=0.01, acceptance=0.9, compute=0.03)
    jitter = [0.008, 0.012] * 20  # a loopback chain's probed round trip, either side of 10 ms
    decisions = [tuner.next_k(rtt, limit=100) > 0 for rtt in jitter]
    assert decisions[0] is False  # below min_rtt, never on: nothing drafts on loopback
    assert all(decisions[1:])  # on from the first round trip at min_rtt, and it stays on
    assert tuner.next_k(0.0075, limit=100) > 0  # still above GATE_OFF * min_rtt
    assert tuner.next_k(GATE_OFF * 0.01 * 0.9, limit=100) == 0  # truly nearer: off
    assert tuner.next_k(0.009, limit=100) == 0  # and on again only from min_rtt
    assert tuner.next_k(0.01, limit=100) > 0


# Pipelined verification: two hops 50 ms away, a forward 20 ms per hop. A frame is relayed (2 round trips); an
# unpipelined verify step is pushed (1.5).
FRAME_RTT, VERIFY_RTT, WORK = 0.1, 0.075, 0.04  # WORK: the chain's compute per step


def test_frames_go_ahead_only_above_the_break_even_chance_of_being_right() -> None:
    even = pipeline_break_even(8, FRAME_RTT, WORK, VERIFY_RTT)
    assert even is not None and 0.5 < even < 0.9
    assert pipelining_pays(even + 0.01, 8, FRAME_RTT, WORK, VERIFY_RTT)
    assert not pipelining_pays(even - 0.01, 8, FRAME_RTT, WORK, VERIFY_RTT)


def test_pipelining_pays_more_the_further_the_nodes_and_never_on_loopback() -> None:
    near = pipeline_break_even(8, 0.02, WORK, 0.015)
    far = pipeline_break_even(8, 0.3, WORK, 0.225)
    assert near is not None and far is not None and far < near
    assert pipeline_break_even(8, 0.0, WORK, 0.0) is None  # no round trip to hide: a void frame only costs


def test_a_tuner_pipelines_once_it_has_seen_rounds_kept_whole_and_only_alone() -> None:
    def tuner(pipeline: Literal["off", "auto", "always"], whole_rounds: int) -> SpecTuner:
        made = SpecTuner(8, 0.01, acceptance=0.95, compute=WORK, pipeline=pipeline)
        for _ in range(whole_rounds):
            made.record_round(8, 8)
        made.next_k(VERIFY_RTT, 100, VERIFY_RTT, 0, FRAME_RTT)
        return made

    assert not tuner("auto", 0).pipelined  # the prior: no frame ahead before rounds are seen kept whole
    assert tuner("auto", 6).pipelined
    assert not tuner("off", 6).pipelined
    assert tuner("always", 0).pipelined
    rejecting = tuner("auto", 6)
    for _ in range(4):
        rejecting.record_round(8, 3)
    rejecting.next_k(VERIFY_RTT, 100, VERIFY_RTT, 0, FRAME_RTT)
    assert not rejecting.pipelined  # rounds that reject a draft: frames ahead would be void
    beside = tuner("auto", 6)
    assert beside.next_k(VERIFY_RTT, 100, VERIFY_RTT, batch_rows=2, frame_rtt=FRAME_RTT) > 0
    assert not beside.pipelined  # a frame would run outside the other generations' batched forwards
    below = SpecTuner(8, 0.5, acceptance=0.99, compute=WORK, pipeline="always")
    assert below.next_k(VERIFY_RTT, 100, VERIFY_RTT, 0, FRAME_RTT) == 0 and not below.pipelined  # the min_rtt gate


def test_frames_in_flight_on_different_nodes_pay_where_compute_is_the_bound() -> None:
    assert pipeline_break_even(8, FRAME_RTT, 0.3, VERIFY_RTT, hops=1) is None  # one node: frames take turns on it
    two = pipeline_break_even(8, FRAME_RTT, 0.3, VERIFY_RTT, hops=2)
    assert two is not None and two < 0.8  # two: frame n + 1 runs on the first while frame n runs on the second


def test_a_draft_model_too_slow_to_draft_step_by_step_drafts_frames_ahead_while_the_one_before_travels() -> None:
    """A draft model as large as the served one (0.14 s a drafted token beside 0.1 s of the chain's compute): drafting
    before each verify step costs about what the traversals it saves give back, so unpipelined it is priced out; a
    frame ahead is drafted while the frame before it travels, and then it pays."""

    def tuner(pipeline: Literal["off", "auto", "always"], kept: int = 4) -> SpecTuner:
        made = SpecTuner(8, 0.01, acceptance=0.95, compute=COMPUTE, draft_cost=0.14, pipeline=pipeline)
        for _ in range(6):
            made.record_round(4, kept)
        return made

    assert tuner("off").next_k(RTT, 100, RTT, 0, FRAME_RTT) == 0  # step by step it does not pay
    auto = tuner("auto")
    assert auto.next_k(RTT, 100, RTT, 0, FRAME_RTT) > 0 and auto.pipelined
    beside = tuner("auto")
    assert beside.next_k(RTT, 100, RTT, batch_rows=2, frame_rtt=FRAME_RTT) == 0  # frames run outside the batch
    assert not beside.pipelined
    rejecting = tuner("auto", kept=2)  # rounds that reject drafts: frames ahead would be void
    assert rejecting.next_k(RTT, 100, RTT, 0, FRAME_RTT) == 0 and not rejecting.pipelined
    slower = SpecTuner(8, 0.01, acceptance=0.95, compute=COMPUTE, draft_cost=0.2, pipeline="auto")
    for _ in range(6):
        slower.record_round(4, 4)
    assert slower.next_k(RTT, 100, RTT, 0, FRAME_RTT) == 0  # drafting alone takes longer than a plain token
