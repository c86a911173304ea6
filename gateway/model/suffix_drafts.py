"""Suffix drafts (SuffixDecoding's idea): the continuation of the text's longest suffix that occurred before, in this
generation's prompt and output or in recent outputs of every generation of the same model on this gateway, chosen
by frequency.

    context ... a b c  ─longest earlier match of its suffix (2 to MAX_MATCH tokens)→ the places it occurred
    draft: token by token, the continuation most of those places agree on, while its share stays over MIN_SCORE

With trees (``propose_tree``) the places' continuations form a trie: every continuation at least MIN_TREE_SCORE of
them share, the likeliest first, each node's share the fraction of its parent's places that continue with it; the
decode plan keeps as many of its nodes as pay for their positions.

Tokens are compared as words (``words``: a token's id -> its word's, ``word_ids``): a word after a space and the
same word at the start of a string are one token apart in byte-level vocabularies, and structured output copies the
prompt's words into JSON strings (``Maria`` after ``"`` where the prompt has `` Maria``). Where no two tokens match,
one does when it is such a respelling of a word that occurs at most ``RESPELLED_PLACES`` times before, or a word
that occurs once before, in the prompt (a value copied from text whose punctuation around it differs).

Prompt lookup is the special case of one document with no store (``PromptLookup``). Written here, not taken from
Snowflake's ``arctic-inference`` (which has a C++ suffix tree): on PyPI it ships a source distribution for this
platform whose build pulls a C++ toolchain and torch (``pip install`` did not finish in minutes on this machine), and
it is a vLLM plugin first; matching by a bigram index and a backward compare is a few dozen lines of Python and
microseconds per proposal at our context lengths.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.model.speculation import DraftTree, ScoredTree, SpecTuner

__all__ = ["OutputStore", "SuffixDrafts"]

MAX_MATCH = 8  # longest suffix compared
MIN_MATCH = 2  # a single repeated token predicts too little (but see ``SuffixDrafts._copied_word``)
# A match within the grammar's forced tokens (``":"`` ends every key) says nothing about what follows unless it
# takes in the key itself (``city":"``: a record repeated)
FORCED_MATCH = 3
RESPELLED_PLACES = 2  # a one-token match of a copied word: only a word this rare names something to copy
MIN_SCORE = 0.3  # stop drafting when under this share of the matching places agree (the product along the draft)
MIN_TREE_SCORE = 0.05  # a tree's node: at least this share of the matching places continue with its path
TREE_CANDIDATES = 4  # a tree's candidate nodes per depth (the plan keeps those that pay)
STORE_TOKENS = 65536  # recent outputs kept for every generation of the model, oldest dropped first

Place = tuple[Sequence[int], int]  # a document and the position right after a match in it


class BigramIndex:
    """Where each pair of adjacent words ends, and each word, per document: the seeds of a suffix match."""

    def __init__(self, words: Sequence[int] = ()) -> None:
        self.words = words  # token id -> its word's id (``word_ids``); () or a short table: every token its own
        self.ends: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (word a, word b) -> [(document, end)]
        self.word_ends: dict[int, list[tuple[int, int]]] = {}  # word -> [(document, end)]
        self.documents: dict[int, Sequence[int]] = {}

    def word(self, token: int) -> int:
        return self.words[token] if token < len(self.words) else token

    def add(self, document: int, tokens: Sequence[int], start: int = 0) -> None:
        """Index ``tokens`` (a document's, kept by reference) from position ``start`` on."""
        self.documents[document] = tokens
        for end in range(start + 1, len(tokens) + 1):
            word = self.word(tokens[end - 1])
            self.word_ends.setdefault(word, []).append((document, end))
            if end >= 2:  # noqa: PLR2004 - a pair needs a token before
                self.ends.setdefault((self.word(tokens[end - 2]), word), []).append((document, end))

    def places(self, context: Sequence[int]) -> list[tuple[int, Place]]:
        """(match length, place) of every earlier occurrence of the context's last two words, by match length."""
        seeds = self.ends.get((self.word(context[-2]), self.word(context[-1])), ())
        return [
            (self._match_length(tokens, end, context), (tokens, end)) for tokens, end in self._after(seeds, context)
        ]

    def word_places(self, context: Sequence[int]) -> list[Place]:
        """Every earlier occurrence of the context's last word, with a token after it."""
        return self._after(self.word_ends.get(self.word(context[-1]), ()), context)

    def _after(self, seeds: Sequence[tuple[int, int]], context: Sequence[int]) -> list[Place]:
        found = []
        for document, end in seeds:
            tokens = self.documents.get(document)
            if tokens is None or (tokens is context and end == len(context)) or end >= len(tokens):
                continue  # dropped, the suffix itself, or nothing after it
            found.append((tokens, end))
        return found

    def _match_length(self, tokens: Sequence[int], end: int, context: Sequence[int]) -> int:
        length, word = 0, self.word
        while length < min(MAX_MATCH, end, len(context)) and word(tokens[end - 1 - length]) == word(
            context[-1 - length]
        ):
            length += 1
        return length


def draft_from(places: list[Place], k: int) -> list[int]:
    """Up to ``k`` tokens that most of ``places`` continue with, token by token, while the share agreeing (the
    product along the draft) stays over ``MIN_SCORE``; ties go to the latest place."""
    drafts: list[int] = []
    score = 1.0
    while places and len(drafts) < k:
        counts = Counter(tokens[end] for tokens, end in reversed(places))
        token, count = counts.most_common(1)[0]
        score *= count / len(places)
        if score < MIN_SCORE:
            break
        drafts.append(token)
        places = [(tokens, end + 1) for tokens, end in places if tokens[end] == token and end + 1 < len(tokens)]
    return drafts


def tree_from(places: list[Place], depth: int, size: int) -> ScoredTree:
    """The trie of ``places``' continuations up to ``depth`` deep, best first by the share of all places that
    continue with a node's path (over ``MIN_TREE_SCORE``), at most ``size`` nodes; ties go to the latest place."""
    tokens: list[int] = []
    parents: list[int] = []
    shares: list[float] = []
    serial = 0  # a unique tiebreak: the heap never compares places
    frontier: list[tuple[float, int, int, int, float, list[Place], int]] = []  # -score, serial, token, parent, ...

    def expand(node: int, at: list[Place], score: float, level: int) -> None:
        nonlocal serial
        if level >= depth:
            return
        counts = Counter(tokens_[end] for tokens_, end in reversed(at))
        for token, count in counts.most_common():
            if score * count / len(at) < MIN_TREE_SCORE:
                break
            after = [(tokens_, end + 1) for tokens_, end in at if tokens_[end] == token and end + 1 < len(tokens_)]
            serial += 1
            heapq.heappush(frontier, (-score * count / len(at), serial, token, node, count / len(at), after, level))

    expand(-1, places, 1.0, 0)
    while frontier and len(tokens) < size:
        negative, _, token, parent, share, after, level = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        shares.append(share)
        if after:
            expand(len(tokens) - 1, after, -negative, level + 1)
    return ScoredTree(DraftTree(tokens, parents), shares)


@dataclass
class OutputStore:
    """Recent outputs of every generation of one model on this gateway (agents repeat code and text across turns
    and sessions). Written by the event loop as generations end, read by the head batcher's thread."""

    max_tokens: int = STORE_TOKENS
    words: Sequence[int] = ()  # ``BigramIndex.words``
    index: BigramIndex = field(init=False)
    _order: list[int] = field(default_factory=list)
    _tokens: int = 0
    _entries: int = 0  # index entries, dropped outputs' included
    _serial: int = 0

    def __post_init__(self) -> None:
        self.index = BigramIndex(self.words)

    def add(self, output: Sequence[int]) -> None:
        if len(output) < MIN_MATCH + 1:
            return
        self._serial += 1
        self.index.add(self._serial, list(output))
        self._order.append(self._serial)
        self._tokens += len(output)
        self._entries += len(output) - 1
        while self._tokens > self.max_tokens and len(self._order) > 1:
            self._tokens -= len(self.index.documents.pop(self._order.pop(0)))
        if self._entries > 2 * self._tokens:
            self._reindex()  # dropped outputs' entries are skipped on lookup; purge them now and then

    def _reindex(self) -> None:
        fresh = BigramIndex(self.words)
        for document in self._order:
            fresh.add(document, self.index.documents[document])
        self.index, self._entries = fresh, self._tokens - len(self._order)


class SuffixDrafts:
    """One generation's drafter: suffix matches over its prompt and output, and over the store's outputs."""

    threaded = False  # microseconds: done in the head batcher's thread, beside the sampling
    unpriced = 0.0

    def __init__(
        self, prompt_ids: Sequence[int], tuner: SpecTuner, store: OutputStore | None = None, words: Sequence[int] = ()
    ) -> None:
        self.context = list(prompt_ids)
        self.tuner = tuner
        self._prompt = len(self.context)
        self._store = store
        self._words = store.words if store is not None else words  # one table: the store's index uses it too
        self._own: BigramIndex | None = None  # built on the first proposal (in the head batcher's thread)

    def emitted(self, token_id: int) -> None:
        self.context.append(token_id)
        if self._own is not None:
            self._own.add(0, self.context, len(self.context) - 1)

    def propose(self, k: int, after: Sequence[int] = (), forced: int = 0) -> list[int]:
        places = self._places(k, after, forced)
        return draft_from(places, k) if places else []

    def propose_tree(self, depth: int, after: Sequence[int] = (), forced: int = 0) -> ScoredTree | None:
        places = self._places(depth, after, forced)
        return tree_from(places, depth, TREE_CANDIDATES * depth) if places else None

    def _places(self, k: int, after: Sequence[int], forced: int = 0) -> list[Place]:
        """The places that match the longest suffix of the text so far and ``after`` ([] when none is long enough;
        a match within the last ``forced`` tokens, the grammar's, must be ``FORCED_MATCH`` long)."""
        context = [*self.context, *after] if after else self.context
        if k <= 0 or len(context) < MIN_MATCH:
            return []
        if self._own is None:
            self._own = BigramIndex(self._words)
            self._own.add(0, self.context)
        found = self._own.places(context)
        if self._store is not None:
            found += self._store.index.places(context)
        longest = max((length for length, _ in found), default=0)
        if longest < FORCED_MATCH and forced > 0 and longest <= forced:
            return []  # ``":"`` after a key matches every earlier key: it would draft the last value, not this one
        if longest < MIN_MATCH:
            return self._copied_word(context)
        return [place for length, place in found if length == longest]

    def _copied_word(self, context: Sequence[int]) -> list[Place]:
        """The places of the context's last word when it is rare (at most ``RESPELLED_PLACES`` earlier occurrences)
        and a copy: spelled otherwise at one of them (a word copied from the prompt into a string), or found only in
        the prompt (``"mar`` where the prompt has ``(maria.lopez@``: the text around a copied value differs); else
        none."""
        assert self._own is not None
        places = self._own.word_places(context)
        in_prompt = (  # and the word itself written after it
            len(context) > self._prompt
            and len(places) == 1
            and places[0][0] is self.context
            and places[0][1] <= self._prompt
        )
        if self._store is not None:
            places += self._store.index.word_places(context)
        last = context[-1]
        if not places or len(places) > RESPELLED_PLACES:
            return []
        if all(tokens[end - 1] == last for tokens, end in places) and not (in_prompt and len(places) == 1):
            return []  # a word the text has had before as it is: one token of context predicts too little
        return places

    def publish(self) -> None:
        """The output so far goes into the store, for later generations of the model."""
        if self._store is not None:
            self._store.add(self.context[self._prompt :])
