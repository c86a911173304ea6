"""A GGUF file's transformers config and tokenizer, converted once per machine and kept on disk.

transformers builds a GGUF file's config by parsing the whole file with gguf-py, vocabulary included: 4.3-5.1 s for
SmolLM2 on a quiet core here, and every node on a machine did it at every start (24 nodes starting together on two
cores: two minutes of CPU). transformers stays the one that converts — the config is exactly its own — and the result
is stored as its ``to_dict()`` under a key of everything that can change it: the file (resolved path, size,
modification time) and the transformers version. A lock file makes nodes that start together wait for the first
one's conversion instead of each doing it.

The gateway's tokenizer is the same story (4.5 s to convert SmolLM2's from the GGUF on a quiet core, 0.3 s to read it
back from the folder transformers' ``save_pretrained`` writes): it is stored that way, and kept only if what reads
back encodes, decodes and templates exactly as what was converted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import transformers
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from shared.file_lock import held

logger = logging.getLogger(__name__)

Converted = TypeVar("Converted")


def cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


def cached_config(gguf_path: Path, cache_dir: Path, convert: Callable[[], PretrainedConfig]) -> PretrainedConfig:
    """The config ``convert`` gives for ``gguf_path``, from ``cache_dir`` when an entry for this exact file exists.

    A cache that cannot be read or written costs only the conversion (logged), never the start.
    """
    return _cached(cache_dir / f"{cache_key(gguf_path)}.json", _read, convert, _write)


def _cached(
    entry: Path,
    read: Callable[[Path], Converted | None],
    convert: Callable[[], Converted],
    write: Callable[[Path, Converted], None],
) -> Converted:
    """What ``read`` finds in ``entry``, else ``convert``'s result, written there (a failed write is logged only);
    under the entry's lock, so processes starting together convert once."""
    with held(entry.with_name(f"{entry.name}.lock")):
        found = read(entry)
        if found is not None:
            return found
        converted = convert()
        try:
            write(entry, converted)
        except (OSError, TypeError, ValueError):
            logger.warning("cannot write the cache entry %s", entry, exc_info=True)
        return converted


def _read(entry: Path) -> PretrainedConfig | None:
    try:
        values = json.loads(entry.read_text())
        config: PretrainedConfig = CONFIG_MAPPING[values["model_type"]].from_dict(values)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("config cache entry %s unreadable; converting again", entry, exc_info=True)
        return None
    return config


def _write(entry: Path, config: PretrainedConfig) -> None:
    partial = entry.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(config.to_dict()))
    partial.replace(entry)  # a reader without the lock (none today) never sees half an entry


def cached_tokenizer(
    gguf_path: Path, cache_dir: Path, convert: Callable[[], PreTrainedTokenizerBase]
) -> PreTrainedTokenizerBase:
    """The tokenizer ``convert`` gives for ``gguf_path``, from ``cache_dir`` when an entry for this exact file exists.

    As ``cached_config``: a cache that cannot be read or written (or reads back different) costs only the conversion.
    """
    return _cached(cache_dir / f"{cache_key(gguf_path)}.tokenizer", _read_tokenizer, convert, _write_tokenizer)


def _read_tokenizer(entry: Path) -> PreTrainedTokenizerBase | None:
    if not entry.is_dir():
        return None
    try:
        stored: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(entry))
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("tokenizer cache entry %s unreadable; converting again", entry, exc_info=True)
        return None
    return stored


# Checked on the entry before it is kept: plain text, whitespace runs, code, non-Latin script and the special tokens.
_PROBE = "Hello world!  Two  spaces,\n\ttabs; def f(x):\n    return x**2 # émoji 🎉 日本語"
_PROBE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _PROBE}]


def _write_tokenizer(entry: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    partial = entry.with_suffix(f".{os.getpid()}.tmp")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(str(partial))
    stored = AutoTokenizer.from_pretrained(str(partial))
    if _tokenizer_behaviour(stored) != _tokenizer_behaviour(tokenizer):
        shutil.rmtree(partial, ignore_errors=True)
        raise ValueError(f"the tokenizer saved for {entry.name} reads back different from the converted one")
    shutil.rmtree(entry, ignore_errors=True)  # an unreadable earlier entry
    partial.replace(entry)  # a reader without the lock (none today) never sees half an entry


def _tokenizer_behaviour(tokenizer: PreTrainedTokenizerBase) -> tuple[object, ...]:
    text = _PROBE + "".join(tokenizer.all_special_tokens)
    ids = tokenizer(text)["input_ids"]
    chat = tokenizer.apply_chat_template(_PROBE_CHAT, tokenize=False) if tokenizer.chat_template else None
    return (
        tokenizer.get_vocab(),
        tokenizer.all_special_tokens,
        tokenizer.chat_template,
        ids,
        tokenizer.decode(ids),
        chat,
    )
