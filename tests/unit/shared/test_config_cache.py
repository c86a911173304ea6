"""A GGUF file's config is converted by transformers once per file and transformers version, then read from disk;
nodes starting together wait for one conversion instead of each doing their own."""

from __future__ import annotations

import copy
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from gateway.model.files import load_tokenizer
from shared import config_cache
from shared.config_cache import cache_key, cached_config
from shared.model_source import load_config, resolve_model
from tests.helpers.model_loads import record_model_loads
from tests.helpers.smollm2 import load_tokenizer as smollm2_tokenizer


@pytest.fixture(scope="module")
def smollm2_config(smollm2_gguf: Path) -> PretrainedConfig:
    """transformers' own conversion of SmolLM2's config, done once: some 10 CPU s here each time."""
    return load_config(resolve_model(str(smollm2_gguf)))


def counting(converted: PretrainedConfig, calls: list[int]) -> PretrainedConfig:
    """A conversion that counts its calls: a fresh copy of ``converted`` each time, as a real conversion gives."""
    calls.append(1)
    return copy.deepcopy(converted)


def test_a_config_is_converted_once_then_read_back_equal(
    smollm2_gguf: Path, smollm2_config: PretrainedConfig, tmp_path: Path
) -> None:
    source, calls = resolve_model(str(smollm2_gguf)), []
    first = cached_config(smollm2_gguf, tmp_path, lambda: counting(smollm2_config, calls))
    again = cached_config(smollm2_gguf, tmp_path, lambda: counting(smollm2_config, calls))
    assert len(calls) == 1
    assert type(again) is type(first) and again.to_dict() == first.to_dict()
    assert load_config(source, tmp_path).to_dict() == first.to_dict()  # the node's path reads the same entry


def test_a_changed_file_is_converted_again(
    smollm2_gguf: Path, smollm2_config: PretrainedConfig, tmp_path: Path
) -> None:
    replaced = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf, replaced)
    calls: list[int] = []
    cached_config(replaced, tmp_path / "cache", lambda: counting(smollm2_config, calls))
    before = cache_key(replaced)
    os.utime(replaced, ns=(time.time_ns(), time.time_ns() + 10**9))  # replaced in place: a new modification time
    assert cache_key(replaced) != before
    cached_config(replaced, tmp_path / "cache", lambda: counting(smollm2_config, calls))
    assert len(calls) == 2


def test_an_unreadable_entry_is_converted_again(
    smollm2_gguf: Path, smollm2_config: PretrainedConfig, tmp_path: Path
) -> None:
    calls: list[int] = []
    (tmp_path / f"{cache_key(smollm2_gguf)}.json").write_text("{not json")
    config = cached_config(smollm2_gguf, tmp_path, lambda: counting(smollm2_config, calls))
    assert len(calls) == 1 and config.model_type == "llama"
    assert cached_config(smollm2_gguf, tmp_path, lambda: counting(smollm2_config, calls)).to_dict() == config.to_dict()
    assert len(calls) == 1  # the bad entry was replaced


def blocked_lock_waiters() -> int:
    return sum(" -> " in line for line in Path("/proc/locks").read_text().splitlines())


def test_nodes_starting_together_convert_once(
    smollm2_gguf: Path, smollm2_config: PretrainedConfig, tmp_path: Path
) -> None:
    """The second waits on the lock (seen in /proc/locks) while the first converts, then reads its entry."""
    calls: list[int] = []
    converting, release = threading.Event(), threading.Event()

    def first_convert() -> PretrainedConfig:
        converting.set()
        assert release.wait(60)
        return counting(smollm2_config, calls)

    configs: list[PretrainedConfig] = []
    first = threading.Thread(target=lambda: configs.append(cached_config(smollm2_gguf, tmp_path, first_convert)))
    second = threading.Thread(
        target=lambda: configs.append(cached_config(smollm2_gguf, tmp_path, lambda: counting(smollm2_config, calls)))
    )
    waiting = blocked_lock_waiters()
    first.start()
    assert converting.wait(60)
    second.start()
    deadline = time.monotonic() + 60
    while blocked_lock_waiters() <= waiting:
        assert time.monotonic() < deadline, "the second never waited on the lock"
        time.sleep(0.01)
    release.set()
    first.join(120)
    second.join(120)
    assert len(calls) == 1 and len(configs) == 2
    assert configs[0].to_dict() == configs[1].to_dict()


def test_a_gguf_tokenizer_is_converted_once_then_read_back_identical(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's path (load_tokenizer with the cache folder): the second load reads the stored folder, and it
    tokenizes, decodes and templates exactly as transformers' conversion of the GGUF."""
    source = resolve_model(str(smollm2_gguf))
    converted = smollm2_tokenizer(smollm2_gguf)  # transformers' conversion, kept across runs by the test helper
    conversions = record_model_loads(monkeypatch)
    first = load_tokenizer(source, cache_dir=tmp_path)
    stored = load_tokenizer(source, cache_dir=tmp_path)
    assert conversions == ["the tokenizer"] and (tmp_path / f"{cache_key(smollm2_gguf)}.tokenizer").is_dir()
    assert stored is not first  # read back from disk, not handed the converted object
    text = "<|im_start|>user\nSay  hi, then\tdef f(x):\n    return x  # 🎉 日本語<|im_end|>"
    assert stored(text)["input_ids"] == converted(text)["input_ids"]
    assert stored.decode(converted(text)["input_ids"]) == converted.decode(converted(text)["input_ids"])
    chat = [{"role": "user", "content": text}]
    assert stored.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert stored.get_vocab() == converted.get_vocab() and stored.eos_token == converted.eos_token


def test_a_tokenizer_that_reads_back_different_is_not_kept(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = resolve_model(str(smollm2_gguf))
    behaviour = config_cache._tokenizer_behaviour
    seen: list[int] = []

    def drifting(tokenizer: PreTrainedTokenizerBase) -> tuple[object, ...]:
        seen.append(1)
        return (*behaviour(tokenizer), len(seen))  # the read-back differs from the converted one

    monkeypatch.setattr(config_cache, "_tokenizer_behaviour", drifting)
    tokenizer = load_tokenizer(source, cache_dir=tmp_path)
    assert tokenizer.eos_token == "<|im_end|>"  # the conversion still serves
    assert not (tmp_path / f"{cache_key(smollm2_gguf)}.tokenizer").exists()
    assert not list(tmp_path.glob("*.tmp"))
