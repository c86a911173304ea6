"""The verification policy: probation states, reputation, how often steps are checked (pure logic)."""

from __future__ import annotations

import pytest

from gateway.swarm.verify.trust import LOW_REPUTATION_BOOST, START, TrustBook, Verification


def test_a_new_node_waits_in_probation_unrouted_until_it_passes() -> None:
    book = TrustBook()
    assert book.see("a", (0, 6))
    assert book.nodes["a"].state is Verification.PROBATION
    assert not book.routable("a") and book.excluded(["a"]) == {"a"}
    book.passed("a", "agreed with b")
    assert book.routable("a") and book.excluded(["a"]) == frozenset()
    assert not book.see("a", (0, 6))  # the same record again: nothing new


def test_failed_and_unverified_nodes() -> None:
    book = TrustBook()
    book.see("liar", (0, 6))
    book.failed("liar", "cosine 0.2")
    assert not book.routable("liar") and book.nodes["liar"].reason == "cosine 0.2"
    book.see("first", (0, 6))
    book.unverified("first", "nothing to compare with")
    assert book.routable("first")
    book.confirmed("first")  # a newcomer agreed with it
    assert book.nodes["first"].state is Verification.VERIFIED


def test_moving_to_other_blocks_means_probation_again_but_a_verdict_stays() -> None:
    book = TrustBook()
    book.see("a", (0, 3))
    book.passed("a", "ok")
    book.agreed("a")
    reputation = book.reputation("a")
    assert book.see("a", (3, 6))  # new blocks: challenged again, reputation kept
    assert book.nodes["a"].state is Verification.PROBATION and book.reputation("a") == reputation
    book.see("liar", (0, 3))
    book.failed("liar", "bad")
    assert not book.see("liar", (3, 6)) and book.nodes["liar"].state is Verification.FAILED


def test_an_outvote_takes_a_new_node_out_and_a_dispute_takes_two() -> None:
    book = TrustBook(threshold=0.3)
    for peer in ("x", "y"):
        book.see(peer, (0, 6))
        book.passed(peer, "ok")
    assert book.lost("x", "outvoted", outvoted=True)
    assert book.nodes["x"].state is Verification.DISTRUSTED and not book.routable("x")
    assert not book.lost("y", "disputed", outvoted=False)  # 0.5 * 0.7 = 0.35: still in
    assert book.routable("y")
    assert book.lost("y", "disputed again", outvoted=False)
    assert book.nodes["y"].checks == {"disputed": 2}


def test_reputation_grows_with_agreement_and_orders_routing() -> None:
    book = TrustBook()
    for peer in ("old", "new"):
        book.see(peer, (0, 6))
        book.passed(peer, "ok")
    for _ in range(20):
        book.agreed("old")
    assert START < book.reputation("old") < 1
    assert book.penalty("old") < book.penalty("new")
    book.agreed("new", self_check=True)  # a sole replica agreeing with itself proves no honesty
    assert book.reputation("new") == START and book.nodes["new"].checks == {"agreed": 1}


def test_checks_are_picked_in_proportion_to_compute_and_boosted_for_low_reputation() -> None:
    book = TrustBook()
    book.see("new", (0, 6))
    book.see("old", (0, 6))
    for _ in range(40):
        book.agreed("old")
    # A decode step (1 token) whose check re-runs a 100-token prefix: rate / 100.
    assert book.check_probability("old", 1, 100, 0.02) == pytest.approx(0.0002)
    assert book.check_probability("new", 1, 100, 0.02) == pytest.approx(0.0002 * LOW_REPUTATION_BOOST)
    assert book.check_probability("old", 10, 10, 0.02) == pytest.approx(0.02)  # a prefill: its own size
    assert book.check_probability("old", 1, 1, 1000.0) == 1.0
