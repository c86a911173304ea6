"""The served model's tokenizer behind the plain ``TokenCodec`` interface the HTTP layer uses."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

from gateway.generation import ChatTemplateMissing, InvalidPrompt

# Fill-in-the-middle token spellings: StarCoder / SantaCoder, and Qwen2.5-Coder.
_FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte fallback


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the printable character each byte is spelled with -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


class HFTokenCodec:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
        self._bytes = functools.lru_cache(maxsize=65536)(self._token_bytes)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        result: bytes = self._bytes(token_id)
        return result

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        if not self._tokenizer.chat_template:
            raise ChatTemplateMissing("this model's tokenizer has no chat template; use /v1/completions")
        try:
            text = self._tokenizer.apply_chat_template(
                messages,
                tools=tools,  # type: ignore[arg-type]  # transformers types the list's items too narrowly
                tokenize=False,
                add_generation_prompt=True,
                **(template_kwargs or {}),
            )
        except TemplateError as exc:
            # Templates reject conversations they cannot render (e.g. roles that do not alternate).
            raise InvalidPrompt(f"the chat template rejected the messages: {exc}") from None
        return str(text)

    def chat_template(self) -> str | None:
        template = self._tokenizer.chat_template
        return template if isinstance(template, str) else None

    def fim_ids(self) -> tuple[int, int, int] | None:
        vocab = self._tokenizer.get_vocab()
        for spelling in _FIM_SPELLINGS:
            if all(token in vocab for token in spelling):
                prefix, suffix, middle = (vocab[token] for token in spelling)
                return prefix, suffix, middle
        return None

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and token_id not in self._tokenizer.all_special_ids:
                alphabet = _byte_level_alphabet()
                if all(char in alphabet for char in piece):
                    return bytes(alphabet[char] for char in piece)
            match = _BYTE_TOKEN.match(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return str(self._tokenizer.decode([token_id])).encode("utf-8")


def word_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token id -> the id of the same word without its leading space, where the vocabulary has both spellings
    (byte-level BPE's ``Ġ``, sentencepiece's ``▁``); else the token's own id. Suffix drafts compare words by it."""
    vocab = tokenizer.get_vocab()
    words = list(range(max(vocab.values(), default=-1) + 1))
    for text, token in vocab.items():
        if len(text) > 1 and text[0] in ("Ġ", "▁"):
            words[token] = vocab.get(text[1:], token)
    return words
