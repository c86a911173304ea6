"""Constrained decoding: a grammar (JSON schema, Lark, regex) turned into a mask over the vocabulary per token.

    Grammar ─GrammarCompiler.constraint→ Constraint ─mask (worker thread, while the nodes compute)→ bitmask [1, W]
    sampled token ─Constraint.advance→ the matcher moves on, and the next mask starts computing at once
    the matcher's state ─Constraint.forced→ the tokens of the bytes the grammar forces next: speculative drafts

The engine is llguidance (Microsoft's Rust Earley parser + token trie, MIT, released every few weeks and used by
vLLM, SGLang and llama.cpp). Measured on this 2-core CPU with SmolLM2's 49152-token vocabulary, random tokens
walking each grammar (``bench/bench_grammar.py`` reruns the llguidance figures):

    engine            compile (5 schemas)   mask per token (median)   JSON schema coverage
    llguidance 1.9    1-2 ms                0.11 ms                   bounds, patterns, formats, $ref, anyOf: all kept
    xgrammar 0.2.9    1-13 ms               0.06-0.24 ms              all kept, but the wheel requires torch + triton
    outlines-core     10 ms-5.7 s           0.01-6.6 ms               integer bounds ignored; {"type":"object"} 5.7 s

llguidance has the coverage, a mask far under a millisecond, no dependencies (xgrammar declares triton and a torch
of its own), and it never raises on a bad token: the matcher enters an error state we turn into "end here".

The mask for the next token is computed in a worker thread started once a token is sampled (``prefetch``, from the
engine's loop, not inside the sampling thread: a thread woken there fights it for the GIL, which measured
milliseconds on this busy 2-core box), so it overlaps the nodes' forward of that token; ``apply`` only takes it
(usually done) and writes -inf over the rest.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import numpy
import torch
from transformers import PreTrainedTokenizerBase, TokenizersBackend

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from gateway.generation import Grammar, InvalidGrammar

# Masks are a few hundred microseconds each: a couple of threads serve every constrained sequence of the gateway.
_MASK_THREADS = 2

# Punctuation a value copied from prose ends at (``Constraint._mark``): quotes, ``@``, ``-`` and ``/`` are inside
# values (e-mail addresses, dates, paths) far more often than at their end
_PHRASE_MARKS = frozenset(b",;:.!?()[]")
_WORD_MARKS = frozenset(b".:!?")  # of those, the ones also found inside a word (``example.com``, ``10:30``)

# Compact JSON (no free whitespace): a model that likes newlines cannot fill the budget with them.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class Constraint:
    """One sequence's grammar state: which tokens may come next.

    ``prefetch`` starts the next mask in a worker thread (the engine calls it once a token is sampled, while the
    nodes run that token); ``apply`` takes it, or computes it on the spot when nothing was prefetched.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        pool: concurrent.futures.Executor,
        tokenizer: llguidance.LLTokenizer | None = None,
    ) -> None:
        self._matcher = matcher
        self._tokenizer = tokenizer  # spells the forced bytes as tokens (``forced``); None: nothing is forced
        self._pool = pool
        self._vocab_size = vocab_size
        self._next: concurrent.futures.Future[torch.Tensor] | None = None
        # forced token -> the shorter token the model wrote instead (``respell``), for this sequence's later drafts
        self._spellings: dict[int, int] = {}
        # a drafter's token -> the longer one the model wrote instead (``respell_draft``: ``",`` for ``,``)
        self._draft_spellings: dict[int, int] = {}
        self._value_end: int | None = None  # the token the model ends a copied value with there (``",``)
        self.prefetch()  # the first mask computes while the prompt is prefilled

    def prefetch(self) -> None:
        if self._next is None:
            self._next = self._pool.submit(self._compute)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> a copy with every token the grammar forbids next at -inf."""
        allowed = self._compute() if self._next is None else self._next.result()
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> None:
        """``token`` was sampled: the matcher takes it (tens of microseconds); the next mask is not started here,
        since a worker thread woken inside the sampling path contends for the GIL with the rest of that path."""
        self._matcher.consume_token(token)
        self._next = None

    def forced(self) -> list[int]:
        """The bytes the grammar forces next (a JSON key and its quotes, a brace), spelled in llguidance's canonical
        tokenization: drafts, not certainties. The mask may allow other spellings of the same bytes (after
        ``{"name`` the grammar forces ``":"``, and ``"``, ``":`` and ``":"`` are all allowed), and the model may
        prefer one of them, so committing these without its scores would change greedy output. Verified as drafts
        they cost nothing extra: they must travel through the chain anyway (the nodes need their keys and values),
        and the head scores their positions in the same matmul. Tens of microseconds."""
        if self._tokenizer is None:
            return []
        self._settle()
        forced = self._matcher.compute_ff_bytes()
        return self._spelled(forced) if forced else []

    def forced_after(self, drafts: Sequence[int]) -> list[int]:
        """The tokens the grammar forces after the text so far and then ``drafts`` (as ``forced``): a draft that
        closes a JSON value is followed by the next key's quotes and colon in the same step. The matcher takes the
        drafts and is rolled back (microseconds); [] when it does not take them all."""
        if self._tokenizer is None or not drafts:
            return []
        self._settle()
        taken = self._matcher.try_consume_tokens(list(drafts))
        try:
            forced = self._matcher.compute_ff_bytes() if taken == len(drafts) else b""
        finally:
            self._matcher.rollback(taken)
        return self._spelled(forced) if forced else []

    def allowed_drafts(self, before: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """A drafter's ``drafts`` after the text so far and ``before``, each spelled as the model spelled it before
        (``respell_draft``), up to the first the grammar forbids: a draft it forbids is a certain rejection. Once the
        model was seen ending a copied value at a punctuation mark, a draft of another mark that ends a phrase there
        (`` (`` or ``)`` before a space) becomes the token the model ended it with."""
        if not drafts:
            return []
        spelled = [self._draft_spelling(token, drafts[index + 1 : index + 2]) for index, token in enumerate(drafts)]
        self._settle()
        allowed = self._matcher.validate_tokens([*before, *spelled]) - len(before)
        return spelled[: max(0, allowed)]

    def respell(self, drafted: int, chosen: int) -> None:
        """The model chose ``chosen`` where the forced draft ``drafted`` stood. When ``chosen`` spells the start of
        the same bytes (``":`` for ``":"``), later forced bytes use it in place of ``drafted``; any other choice
        (the grammar allowed a different continuation) teaches nothing."""
        if self._tokenizer is None or drafted == chosen:
            return
        whole, start = self._tokenizer.decode_bytes([drafted]), self._tokenizer.decode_bytes([chosen])
        if 0 < len(start) < len(whole) and whole.startswith(start):
            self._spellings[drafted] = chosen

    def respell_draft(self, drafted: int, chosen: int) -> None:
        """The model chose ``chosen`` where a drafter's ``drafted`` stood. When ``chosen`` spells more bytes and then
        ``drafted``'s (``",`` for ``,``: a value copied from the prompt ends where the prompt's text has a comma, and
        the model closes the string in the comma's token), later drafts of ``drafted`` are spelled ``chosen``; when
        the model wrote the plain token where its respelling was drafted (a comma inside a value), that is unlearned."""
        if self._tokenizer is None or drafted == chosen:
            return
        unlearned = self._draft_spellings.get(chosen) == drafted
        if unlearned:
            del self._draft_spellings[chosen]
        if drafted == self._value_end and self._mark(chosen):
            self._value_end, unlearned = None, True  # a mark written inside a value: values do not end at marks here
        if unlearned:
            return
        whole, end = self._tokenizer.decode_bytes([chosen]), self._tokenizer.decode_bytes([drafted])
        if 0 < len(end) < len(whole) and whole.endswith(end):
            self._draft_spellings[drafted] = chosen
            if self._mark(drafted):
                self._value_end = chosen

    def _draft_spelling(self, token: int, following: Sequence[int]) -> int:
        """A drafter's ``token`` as the model would write it (``allowed_drafts``): its own learned spelling, or the
        learned value end where ``token`` is a mark that ends a phrase: a bracket or a comma, or any mark with a space
        before it or the next draft's (a mark inside a word, ``example.com``'s dot or ``10:30``'s colon, does not)."""
        spelled = self._draft_spellings.get(token)
        if spelled is not None or self._value_end is None or not self._mark(token):
            return token if spelled is None else spelled
        assert self._tokenizer is not None
        text = self._tokenizer.decode_bytes([token])
        if text.startswith(b" ") or not set(text) & _WORD_MARKS:
            return self._value_end
        if following and self._tokenizer.decode_bytes([following[0]]).startswith(b" "):
            return self._value_end
        return token

    def _mark(self, token: int) -> bool:
        """Whether ``token`` is punctuation that may end a phrase (``,`` ``)`` `` (`` ``.``; a space before it or
        not)."""
        assert self._tokenizer is not None
        core = self._tokenizer.decode_bytes([token]).strip(b" ")
        return bool(core) and all(byte in _PHRASE_MARKS for byte in core)

    def _spelled(self, data: bytes) -> list[int]:
        """``data`` as tokens: llguidance's canonical spelling, but a token the model spelled otherwise as it did
        (its shorter token, then the rest of the bytes spelled the same way)."""
        assert self._tokenizer is not None
        tokens: list[int] = []
        for token in self._tokenizer.tokenize_bytes(data):
            chosen = self._spellings.get(token)
            if chosen is None:
                tokens.append(token)
                continue
            rest = self._tokenizer.decode_bytes([token])[len(self._tokenizer.decode_bytes([chosen])) :]
            tokens += [chosen, *self._spelled(rest)]  # ``rest`` is shorter than the token: this ends
        return tokens

    def _settle(self) -> None:
        if self._next is not None:
            self._next.result()  # a mask in flight holds the matcher (llguidance refuses a second borrower)

    def _compute(self) -> torch.Tensor:
        """-> allowed [V] bool."""
        words = numpy.zeros((self._vocab_size + 31) // 32, dtype=numpy.int32)  # [W]: bit j of word i: token 32i+j
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        # numpy, not torch: a few microseconds, and no torch intra-op thread pool woken from a second thread
        bits = numpy.unpackbits(words.view(numpy.uint8), bitorder="little")[: self._vocab_size]  # [V] 0/1
        return torch.from_numpy(bits.astype(numpy.bool_))


class GrammarCompiler:
    """Grammars compiled against the served model's tokenizer (its token trie is built once, about a second)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self._vocab_size = vocab_size
        if not isinstance(tokenizer, TokenizersBackend):
            raise InvalidGrammar("constrained decoding needs a fast (Rust) tokenizer; this model's is not one")
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_ids))
        self._pool = concurrent.futures.ThreadPoolExecutor(_MASK_THREADS, thread_name_prefix="grammar-mask")

    def constraint(self, grammar: Grammar) -> Constraint:
        """A fresh matcher for ``grammar``; raises ``InvalidGrammar`` when it does not compile. Blocks (up to
        hundreds of ms for huge schemas): call it from a worker thread."""
        matcher = llguidance.LLMatcher(self._tokenizer, _grammar_text(grammar), log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(f"the {grammar.kind} cannot be compiled: {matcher.get_error()}", grammar.param)
        return Constraint(matcher, self._vocab_size, self._pool, self._tokenizer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@functools.lru_cache(maxsize=256)
def _grammar_text(grammar: Grammar) -> str:
    try:
        if grammar.kind == "json_schema":
            schema = json.loads(grammar.source)
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))
        if grammar.kind == "lark":
            return str(llguidance.LLMatcher.grammar_from_lark(grammar.source))
        return str(llguidance.LLMatcher.grammar_from_regex(grammar.source))
    except (ValueError, TypeError) as exc:
        raise InvalidGrammar(f"the {grammar.kind} is not valid: {exc}", grammar.param) from None
