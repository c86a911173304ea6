"""How many tokens to draft: speculation's cost model (``choose_k``) and one generation's estimates behind it
(``SpecTuner``: acceptance per draft, the chain's compute per step, a drafted token's cost, all EWMAs).

Two rules keep the decision from sticking or flipping on noise:

- **Re-probing.** Estimates move only when drafts are made and judged, so a tuner that once priced drafting out
  (k = 0: a draft model's forward measured slow under load, drafts rejected for a while) would never see the cost
  fall or the text turn repetitive. While k = 0 it saves up ``PROBE_BUDGET`` of each plain round's time and spends
  it on a probe round of one draft when the savings cover what that draft can add to a round (drafting it, its
  extra position, a verify step's longer trip), at most every ``PROBE_EVERY`` rounds: where drafting truly does not
  pay, probes cost about ``PROBE_BUDGET`` of the decode time. A probe's draft cost replaces an estimate by the
  weight the rounds since its last measurement earn (the EWMA over rounds, skipped rounds counted), so one probe
  after a long gap says what drafting costs now; acceptance, judged draft by draft (0 or 1 each), stays a plain
  EWMA and needs a few probes to turn.
- **Hysteresis on ``min_rtt``.** Below ``min_rtt`` (loopback) nothing is drafted. On loopback the probed round trip
  (5-12 ms) sits around the 10 ms default, so a bare threshold flips with every probe; a tuner starts drafting once
  the round trip reaches ``min_rtt`` and stops only when it falls below ``GATE_OFF * min_rtt``. Per tuner, so per
  generation: another chain's round trip says nothing about this one's.

**Pipelining** (``pipelining_pays``). Where acceptance is high, the next verify frame can leave before the previous
one returns, drafted on the assumption that the previous one is kept whole (its bonus token guessed too). Frames
then return every half traversal, but they are relayed (a frame is not pushed) and one that was wrong costs its
compute on the nodes before the step sent in its place. Whether a frame ahead is right is measured, not a^(k+1):
rejections cluster (copied text is kept whole for many rounds, then a stretch of new text rejects several), so the
tuner keeps the share of rounds that kept every draft (``kept_whole``) and takes ``kept_whole * acceptance`` (the
bonus guess is one more draft). It pipelines when that beats the unpipelined round of the same k by ``MIN_GAIN``,
and only while the generation decodes alone: a frame runs a forward of its own, outside the other generations'
batches. A draft model drafts a frame ahead while the frame before it travels, so its forwards overlap the chain's
round trips instead of adding to them: where they cost about what a traversal saves (a draft as large as the
served model, on CPUs), unpipelined drafting does not pay and frames ahead may (``pipelined_k``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ACCEPTANCE_PRIOR",
    "EWMA",
    "FORCED_PRIOR",
    "GATE_OFF",
    "MIN_GAIN",
    "POSITION_COST",
    "PROBE_BUDGET",
    "PROBE_EVERY",
    "SpecTuner",
    "choose_k",
    "expected_tokens",
    "WHOLE_PRIOR",
    "pipeline_break_even",
    "pipeline_round",
    "pipelined_k",
    "pipelining_pays",
    "unpipelined_round",
]

# An extra verified position in a batched forward, as a fraction of one row's share of that forward's compute.
# Measured with ``python -m bench.row_cost`` (SmolLM2, one node's 15 blocks, float32, one torch thread, 2 CPUs under
# load 10-38, sessions at 200 tokens): a verify row of k + 1 tokens beside B - 1 decode rows adds 0.24 (B=1, k=4),
# 0.21 (B=1, k=8), 0.23 (B=4, k=4), 0.13 (B=4, k=8), 0.19 (B=8, k=8) of a row's share per extra position (B=8, k=4
# drowned in the load's noise). On an accelerator decode is memory-bound and the figure is far smaller; 0.2 is the
# CPU nodes' (the conservative side). Charged to every row of the forward, a round's extra positions cost
# position_cost * k * compute in all, however many rows share it: a verify step costs no more under load.
POSITION_COST = 0.2
ACCEPTANCE_PRIOR = 0.6  # a fresh generation's guess (prompt lookup drafts only where the text repeats)
FORCED_PRIOR = 0.9  # the same for the grammar's forced tokens: the model rarely spells forced bytes otherwise
EWMA = 0.3  # weight of the newest round in the acceptance and compute estimates
MIN_GAIN = 1.1  # draft only when a round is expected to beat plain decoding by this factor
PROBE_BUDGET = 0.03  # of a generation's plain decode time, what re-probing a priced-out drafter may spend
PROBE_EVERY = 10  # rounds at least between probes: a probe that costs ~nothing (cheap drafts) still not every round
GATE_OFF = 0.7  # a drafting tuner stops below GATE_OFF * min_rtt, not at min_rtt: a probe's jitter is no switch
WHOLE_PRIOR = 0.3  # a fresh generation's chance that a round keeps every draft: frames go ahead once it is seen


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify round of k drafts emits on average (each draft accepted with ``acceptance``, in order,
    plus the token sampled after the last accepted one)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def choose_k(
    acceptance: float,
    rtt: float,
    compute: float,
    k_max: int,
    min_rtt: float,
    draft_cost: float = 0.0,
    plain_rtt: float | None = None,
    position_cost: float = POSITION_COST,
    batch_rows: int = 0,
) -> int:
    """Drafts for the next round: the k in 0..k_max with the least expected time per token, against
    ``plain_rtt + compute`` for a plain decode step (default ``rtt``; less when decode steps are pushed node to node
    and verify steps are relayed). 0 below ``min_rtt`` (a bare threshold: ``SpecTuner`` adds hysteresis) or when
    drafting gains under ``MIN_GAIN``.

    ``compute``: seconds of the chain's forwards per step, as measured now — batched with ``batch_rows`` other
    generations' rows, each forward's compute shared by 1 + batch_rows rows. A verify round's k extra positions
    ride in those forwards and cost ``position_cost`` of one row's share each, paid by every row the forward
    carries (this one waits, and so do the others): the round is charged ``rtt + compute + (1 + batch_rows) *
    position_cost * row * k + draft_cost * k`` with ``row = compute / (1 + batch_rows)`` (``draft_cost``: drafting
    one token, a draft model's forward). A verify step under load is as cheap as its extra positions — no forward
    or message of its own."""
    if k_max <= 0 or rtt < min_rtt:
        return 0
    plain = (rtt if plain_rtt is None else plain_rtt) + compute
    rows = 1 + max(0, batch_rows)
    row = compute / rows  # one row's share of a batched forward

    def round_time(k: int) -> float:
        return rtt + compute + rows * position_cost * row * k + draft_cost * k

    return _fastest_k(round_time, acceptance, plain, k_max)


def _fastest_k(round_time: Callable[[int], float], acceptance: float, plain: float, k_max: int) -> int:
    """The k in 1..k_max whose rounds (``round_time(k)`` seconds each) take the least expected time per token; 0
    unless that beats ``plain`` (a plain decode step) by ``MIN_GAIN``."""
    best_k, best = 0, plain
    for k in range(1, k_max + 1):
        per_token = round_time(k) / expected_tokens(acceptance, k)
        if per_token < best:
            best_k, best = k, per_token
    return best_k if best * MIN_GAIN <= plain else 0


def pipeline_round(
    right: float, k: int, frame_rtt: float, compute: float, hops: int = 1, draft_cost: float = 0.0
) -> float:
    """Seconds per round of k drafts with a frame always sent ahead through ``hops`` nodes. A frame is right (chance
    ``right``: the one before it kept whole, its bonus token guessed) and returns a half traversal after the one
    before it, or one node's forward after it where that is the bound (two frames in flight run on different nodes
    at once); else it was void, and the frame sent in its place takes a whole traversal after the void one's
    forward on the node it had reached. Drafting a frame's k + 1 tokens (``draft_cost`` each) comes before it
    leaves, while the frame before it travels: part of a traversal, and the bound where it is the longest part."""
    work = compute * (1.0 + POSITION_COST * k)
    drafting = draft_cost * (k + 1)
    traversal, node = frame_rtt + work + drafting, work / max(1, hops)
    return right * max(traversal / 2.0, node, drafting) + (1.0 - right) * (traversal + node)


def unpipelined_round(k: int, rtt: float, compute: float, draft_cost: float = 0.0) -> float:
    """Seconds per round of k drafts verified one step after another: drafting them, then the verify step."""
    return rtt + compute * (1.0 + POSITION_COST * k) + draft_cost * k


def pipelining_pays(
    right: float, k: int, frame_rtt: float, compute: float, rtt: float, hops: int = 1, draft_cost: float = 0.0
) -> bool:
    """Whether rounds of k drafts with frames ahead (relayed: ``frame_rtt``) beat unpipelined ones (``rtt``: a
    verify step's round trips) by ``MIN_GAIN``; a round yields the same tokens either way."""
    piped = pipeline_round(right, k, frame_rtt, compute, hops, draft_cost)
    return piped * MIN_GAIN <= unpipelined_round(k, rtt, compute, draft_cost)


def pipelined_k(
    acceptance: float,
    right: float,
    plain: float,
    frame_rtt: float,
    compute: float,
    k_max: int,
    hops: int = 1,
    draft_cost: float = 0.0,
) -> int:
    """Drafts per frame where only frames ahead make drafting pay (a draft model whose forwards cost about as much
    as the round trips they save, drafted while the frame before travels): ``choose_k``'s rule over pipelined
    rounds."""
    return _fastest_k(
        lambda k: pipeline_round(right, k, frame_rtt, compute, hops, draft_cost), acceptance, plain, k_max
    )


def pipeline_break_even(k: int, frame_rtt: float, compute: float, rtt: float, hops: int = 1) -> float | None:
    """The chance of a frame ahead being right above which ``pipelining_pays``; None where it never does."""
    right, wrong = pipeline_round(1.0, k, frame_rtt, compute, hops), pipeline_round(0.0, k, frame_rtt, compute, hops)
    if wrong <= right:
        return None
    even = (wrong - unpipelined_round(k, rtt, compute) / MIN_GAIN) / (wrong - right)
    return max(0.0, even) if even <= 1.0 else None


@dataclass
class SpecTuner:
    """One generation's estimates: acceptance per draft, the chain's compute per step and a drafted token's cost
    (EWMAs); and its decisions' state: the ``min_rtt`` gate (open or closed) and the probe budget saved up."""

    k_max: int
    min_rtt: float
    acceptance: float = ACCEPTANCE_PRIOR
    compute: float = 0.0  # seconds a step takes beyond the round trip
    draft_cost: float = 0.0  # seconds drafting one token takes (a draft model's forward; ~0 for prompt lookup)
    forced_acceptance: float = FORCED_PRIOR  # per forced token (``Constraint.forced``): its own estimate
    # off: never; auto: frames go ahead where ``pipelining_pays``; always: whenever a round drafts (for measuring
    # pipelining where the cost model would not choose it, and for tests on loopback)
    pipeline: Literal["off", "auto", "always"] = "off"
    kept_whole: float = WHOLE_PRIOR  # share of drafting rounds that kept every draft (EWMA)
    pipelined: bool = field(default=False, init=False)  # the latest ``next_k`` chose frames ahead
    gate_open: bool = field(default=False, init=False)  # drafting allowed by the round trip (hysteresis)
    _probe_credit: float = field(default=0.0, init=False, repr=False)  # seconds saved up for a probe
    _plain_rounds: int = field(default=0, init=False, repr=False)  # rounds since the last that drafted (or probed)
    _cost_age: int = field(default=0, init=False, repr=False)  # rounds since ``draft_cost`` was last measured

    def forcing_pays(self, rtt: float, plain_rtt: float | None = None, batch_rows: int = 0) -> bool:
        """Whether a verify step carrying the grammar's forced tokens beats a plain decode step: the cost model for
        one such draft (more pay more), at any round trip — they cost no drafting and are nearly always kept."""
        forced = self.forced_acceptance
        return choose_k(forced, rtt, self.compute, 1, 0.0, 0.0, plain_rtt, batch_rows=batch_rows) > 0

    def next_k(
        self,
        rtt: float,
        limit: int,
        plain_rtt: float | None = None,
        batch_rows: int = 0,
        frame_rtt: float | None = None,
        hops: int = 1,
    ) -> int:
        """Drafts for the next round (``choose_k`` on this generation's estimates, or a probe of one), at most
        ``limit``; ``pipelined`` says whether frames go ahead (``pipeline``; ``frame_rtt``: a relayed traversal's
        round trips, default ``rtt``, through ``hops`` nodes). Called once a round: it counts the rounds that age the
        estimates."""
        self._cost_age += 1
        self.pipelined = False
        if not self._gate(rtt):
            return 0
        k = choose_k(
            self.acceptance, rtt, self.compute, self.k_max, 0.0, self.draft_cost, plain_rtt, batch_rows=batch_rows
        )
        frame = rtt if frame_rtt is None else frame_rtt
        if k == 0 and batch_rows == 0 and self.pipeline != "off":
            plain = (rtt if plain_rtt is None else plain_rtt) + self.compute
            k = pipelined_k(
                self.acceptance, self._right(), plain, frame, self.compute, self.k_max, hops, self.draft_cost
            )
            self.pipelined = k > 0
        elif k > 0:
            self.pipelined = batch_rows == 0 and self._pipelines(k, rtt, frame, hops)
        if k > 0:
            self._probe_credit, self._plain_rounds = 0.0, 0
        else:
            k = self._probe(rtt, rtt if plain_rtt is None else plain_rtt)
        return min(k, max(0, limit))

    def _right(self) -> float:
        """The chance that a frame ahead is right: the one before it kept whole, then its bonus token guessed."""
        return self.kept_whole * self.acceptance

    def _pipelines(self, k: int, rtt: float, frame_rtt: float, hops: int) -> bool:
        if self.pipeline == "always":
            return True
        return self.pipeline == "auto" and pipelining_pays(
            self._right(), k, frame_rtt, self.compute, rtt, hops, self.draft_cost
        )

    def _gate(self, rtt: float) -> bool:
        """Whether the round trip allows drafting: from ``min_rtt`` up, and once open down to ``GATE_OFF`` of it."""
        threshold = GATE_OFF * self.min_rtt if self.gate_open else self.min_rtt
        self.gate_open = rtt >= threshold
        return self.gate_open

    def _probe(self, rtt: float, plain_rtt: float) -> int:
        """1 when this priced-out round should draft anyway to re-measure, else 0. Each plain round saves
        ``PROBE_BUDGET`` of its time; a probe spends what one draft can add to a round at most (drafting it, its
        extra position in every row's forward, a verify step's longer trip: a kept draft only saves time)."""
        self._plain_rounds += 1
        self._probe_credit += PROBE_BUDGET * (plain_rtt + self.compute)
        cost = self.draft_cost + POSITION_COST * self.compute + max(0.0, rtt - plain_rtt)
        if self._plain_rounds < PROBE_EVERY or self._probe_credit < cost:
            return 0
        self._probe_credit -= cost
        self._plain_rounds = 0
        return 1

    def record_draft(self, seconds: float, drafted: int) -> None:
        """``drafted`` tokens drafted in ``seconds``: weighted by the rounds since the last measurement (an EWMA
        over rounds, the rounds that drafted nothing counted), so a probe after a long gap outweighs an old cost."""
        if drafted > 0:
            weight = 1.0 - (1.0 - EWMA) ** max(1, self._cost_age)
            self.draft_cost += weight * (max(0.0, seconds) / drafted - self.draft_cost)
            self._cost_age = 0

    def record_round(self, drafted: int, accepted: int, forced: int = 0) -> None:
        """``drafted`` drafts, the first ``forced`` of them the grammar's: each kind's acceptance on its own (the
        drafter's drafts count only when every forced one before them was kept, else they went unjudged)."""
        if forced > 0:
            self.forced_acceptance += EWMA * (min(accepted, forced) / forced - self.forced_acceptance)
        if drafted > forced and accepted >= forced:
            self.acceptance += EWMA * ((accepted - forced) / (drafted - forced) - self.acceptance)
        if drafted > 0:
            self.kept_whole += EWMA * (float(accepted == drafted) - self.kept_whole)

    def record_step(self, seconds: float, rtt: float) -> None:
        self.compute += EWMA * (max(0.0, seconds - rtt) - self.compute)
