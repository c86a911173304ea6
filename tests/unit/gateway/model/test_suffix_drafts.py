"""Suffix drafts: the longest earlier match wins, frequency picks among its places, the store shares outputs across
generations and forgets the oldest, and forced tokens (``after``) extend the context drafts follow."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.model.speculation import SpecTuner
from gateway.model.suffix_drafts import OutputStore, SuffixDrafts


def drafts(prompt: list[int], k: int, store: OutputStore | None = None, after: Sequence[int] = ()) -> list[int]:
    return SuffixDrafts(prompt, SpecTuner(8, 0.0), store).propose(k, after)


def test_the_prompt_alone_is_prompt_lookup() -> None:
    assert drafts([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]
    assert drafts([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # stops at the end of the text
    assert drafts([1, 2, 3, 4], 3) == []  # the suffix never occurred before
    assert drafts([5, 5], 3) == []


def test_the_longest_match_wins_and_frequency_picks_among_its_places() -> None:
    # "7 2 3" occurred once (-> 8), "2 3" alone three times (-> 4 twice): the longer match decides
    assert drafts([2, 3, 4, 2, 3, 4, 7, 2, 3, 8, 0, 7, 2, 3], 1) == [8]
    # three places continue "2 3" with 4, one with 9 (the latest): frequency, not recency
    assert drafts([2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 0, 2, 3, 9, 6, 2, 3], 1) == [4]


def test_drafting_stops_where_the_places_disagree() -> None:
    # after "2 3 4" two places go on with 5, two with 6: the share halves under the score threshold after two halvings
    prompt = [2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 0, 2, 3]
    proposed = drafts(prompt, 6)
    assert proposed[0] == 4 and len(proposed) < 6


def test_the_store_shares_outputs_across_generations_and_forgets_the_oldest() -> None:
    store = OutputStore(max_tokens=12)
    first = SuffixDrafts([100, 101], SpecTuner(8, 0.0), store)
    for token in [7, 8, 9, 10, 11, 12]:
        first.emitted(token)
    first.publish()
    assert drafts([50, 7, 8], 3, store) == [9, 10, 11]  # another generation drafts from the first one's output
    store.add([20, 21, 22, 23, 24, 25, 26, 27])  # over 12 tokens: the first output goes
    assert drafts([50, 7, 8], 3, store) == []
    assert drafts([50, 21, 22], 2, store) == [23, 24]


def test_forced_tokens_extend_the_context_drafts_follow() -> None:
    assert drafts([1, 2, 3, 4, 5, 6, 0, 1], 2, after=[2, 3]) == [4, 5]
