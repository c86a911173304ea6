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


# A vocabulary where 40 is " Maria" and 41 "Maria", 50 " +" and 51 "+": the same words, one with a leading space.
WORDS = [*range(40), 41, 41, *range(42, 50), 51, 51, *range(52, 100)]


def worded(prompt: list[int], k: int, store: OutputStore | None = None) -> list[int]:
    return SuffixDrafts(prompt, SpecTuner(8, 0.0), store, words=WORDS).propose(k)


def written(prompt: list[int], output: list[int], k: int) -> list[int]:
    """Drafts after ``output`` was emitted after ``prompt``."""
    drafter = SuffixDrafts(prompt, SpecTuner(8, 0.0), words=WORDS)
    for token in output:
        drafter.emitted(token)
    return drafter.propose(k)


def test_tokens_are_matched_as_words() -> None:
    # the prompt has " +" 3 4 " 6"; the output "+" 3 after a quote (9): the pair "+ 3" matches as words
    assert worded([1, 50, 3, 4, 60, 5, 9, 51, 3], 3) == [4, 60, 5]
    assert drafts([1, 50, 3, 4, 60, 5, 9, 51, 3], 3) == []  # token by token, no pair matched


def test_a_rare_word_copied_into_a_string_drafts_on_its_own() -> None:
    # "... Maria Lopez ..." in the prompt; the output starts a string with "Maria" (after a quote, 9): one word
    prompt = [1, 2, 40, 42, 43, 5, 9]
    assert worded([*prompt, 41], 2) == [42, 43]
    assert drafts([*prompt, 41], 2) == []  # without words: another token
    # the same word spelled the same way, written after it occurred once in the prompt: a copy whose punctuation
    # differs ("mar after a quote where the prompt has (mar)
    assert worded([*prompt, 40], 2) == []  # the prompt's own last word: nothing was written yet
    assert written(prompt, [40], 2) == [42, 43]
    # ... but once in the output, or twice in the prompt, a one-token match is too little to go on
    assert written(prompt, [7, 44, 45, 8, 44], 2) == []
    assert written([1, 2, 40, 42, 43, 3, 40, 5, 9], [40], 2) == []
    # a word the text has often is no copy of one place
    common = [1, 40, 42, 2, 40, 44, 3, 40, 45, 9]
    assert worded([*common, 41], 2) == []


def test_the_store_matches_by_words_too() -> None:
    store = OutputStore(max_tokens=100, words=WORDS)
    store.add([7, 50, 3, 4, 60])
    assert worded([9, 51, 3], 2, store) == [4, 60]


def test_a_match_within_the_forced_tokens_drafts_only_when_it_takes_in_the_key() -> None:
    """``":"`` ends every key of a JSON object: matched alone it would draft the last value into this key. A match
    that reaches back to the key (the record repeated) is evidence again."""
    key, other, colon, quote, value = 40, 41, 42, 43, 44
    prompt = [1, key, colon, quote, value, 9]  # ``"name":"Maria"`` earlier
    assert drafts(prompt, 2, after=[other, colon, quote]) == [value, 9]  # not told they were forced
    drafter = SuffixDrafts(prompt, SpecTuner(8, 0.0))
    assert drafter.propose(2, [other, colon, quote], forced=3) == []
    assert drafter.propose(2, [key, colon, quote], forced=3) == [value, 9]  # the same key: three tokens match
    assert drafter.propose(2, [value, colon, quote], forced=2) == []
