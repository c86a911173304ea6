"""Incremental detokenization, stop strings and the per-choice text assembly, with real tokenizers built here."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.generation import GeneratedToken
from gateway.model.tokens import HFTokenCodec
from gateway.text.assembler import TextAssembler
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopMatcher

TEXT = "héllo wörld, 日本語 🙂 and ñandú — “quoted” 🚀🚀"


@pytest.fixture(scope="module")
def byte_level() -> HFTokenCodec:
    """A byte-level BPE that knows few merges: most non-ASCII characters split into several byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tokenizer.train_from_iterator(["hello world and the quick brown fox"] * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    return HFTokenCodec(fast, len(fast))


@pytest.fixture(scope="module")
def metaspace() -> HFTokenCodec:
    """A sentencepiece-style tokenizer (``▁`` marks a word start; a lone token decodes without its space)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"])
    tokenizer.train_from_iterator(["hello world and the quick brown fox jumps"] * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")
    return HFTokenCodec(fast, len(fast))


def test_deltas_never_split_a_character_and_add_up_to_the_text(byte_level: HFTokenCodec) -> None:
    ids = byte_level.encode(TEXT)
    assert len(ids) > len(TEXT)  # multi-byte characters really are split across tokens
    detokenizer = IncrementalDetokenizer(byte_level)
    deltas = [detokenizer.push(token) for token in ids]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + detokenizer.flush() == TEXT
    assert b"".join(byte_level.token_bytes(token) for token in ids) == TEXT.encode()


def test_a_cut_character_comes_out_as_a_replacement_only_at_the_end(byte_level: HFTokenCodec) -> None:
    ids = byte_level.encode("ok 🙂")
    detokenizer = IncrementalDetokenizer(byte_level)
    text = "".join(detokenizer.push(token) for token in ids[:-1])  # the emoji's last byte never comes
    assert "\ufffd" not in text
    assert detokenizer.flush().endswith("\ufffd")


def test_the_first_new_token_keeps_its_space_after_the_prompt(metaspace: HFTokenCodec) -> None:
    prompt = metaspace.encode("the quick brown")
    new = metaspace.encode("fox jumps")
    assert metaspace.decode(new[:1]) == "fox"  # decoded alone, the word-start space is lost
    detokenizer = IncrementalDetokenizer(metaspace, prompt)
    text = "".join(detokenizer.push(token) for token in new) + detokenizer.flush()
    assert text == metaspace.decode(prompt + new)[len(metaspace.decode(prompt)) :] == " fox jumps"


def test_stop_matcher_finds_the_earliest_stop_and_holds_back_prefixes() -> None:
    stops = StopMatcher(["END", "\n\n", ""])
    assert stops.find("abc\n\nxyzEND", 0) == 3  # the earliest of two
    assert stops.find("abc\n\nxyzEND", 10) == 8  # only stops that end in the new text count
    assert stops.find("abcEN", 3) is None
    assert stops.holdback("abcEN") == 2 and stops.holdback("abc\n") == 1 and stops.holdback("abc") == 0
    assert StopMatcher([]).find("anything", 0) is None and StopMatcher([]).holdback("x") == 0


def _assemble(codec: HFTokenCodec, text: str, stops: list[str]) -> tuple[list[str], TextAssembler]:
    assembler = TextAssembler(IncrementalDetokenizer(codec), StopMatcher(stops))
    pieces = []
    for token in codec.encode(text):
        piece = assembler.add(GeneratedToken(token, False, -0.5))
        pieces.append(piece.text)
        if assembler.stopped:
            break
    last = assembler.finish()
    pieces.append(last.text)
    assert last.finish_reason == ("stop" if assembler.stopped else "length")
    return pieces, assembler


def test_a_stop_string_spanning_tokens_is_cut_and_never_streamed(byte_level: HFTokenCodec) -> None:
    pieces, assembler = _assemble(byte_level, "hello world and the quick brown fox", ["d the q"])
    assert "".join(pieces) == "hello world an" and assembler.finish_reason == "stop"
    assert all("d the" not in piece for piece in pieces)
    assert assembler.generated < len(byte_level.encode("hello world and the quick brown fox"))


def test_without_a_stop_everything_comes_out_with_its_tokens(byte_level: HFTokenCodec) -> None:
    assembler = TextAssembler(IncrementalDetokenizer(byte_level), StopMatcher(["zzz"]))
    ids = byte_level.encode(TEXT)
    pieces = [assembler.add(GeneratedToken(token, False, -1.0)) for token in ids]
    pieces.append(assembler.finish())
    assert "".join(p.text for p in pieces) == TEXT
    tokens = [t for p in pieces for t in p.tokens]
    assert [t.token.token_id for t in tokens] == ids  # every token once, in order
    assert tokens[0].offset == 0 and [t.offset for t in tokens] == sorted(t.offset for t in tokens)
    assert pieces[-1].finish_reason == "length" and assembler.logprob_sum == -len(ids)


def test_eos_ends_with_stop_and_adds_no_text(byte_level: HFTokenCodec) -> None:
    assembler = TextAssembler(IncrementalDetokenizer(byte_level), StopMatcher([]))
    first = assembler.add(GeneratedToken(byte_level.encode("hi")[0], False))
    eos = assembler.add(GeneratedToken(0, True))
    assert eos.text == "" and eos.tokens == () and assembler.stopped
    last = assembler.finish()
    assert first.text + last.text == "h" and last.finish_reason == "stop" and assembler.generated == 2
