"""bench/swarm24.py's bookkeeping: a log per node (its start-up phases are read from it), no swarm left on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import httpx
import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from bench import swarm24
from bench.swarm24 import Kill, Started, churn, node_name, reference_texts, spans
from tests.helpers.processes import ManagedProcess


def test_every_node_and_replacement_has_a_log_of_its_own() -> None:
    layout = spans(24)
    assert len(set(layout)) < len(layout)  # spans repeat (0:2 twice): the span alone names no node
    names = [node_name(index, span, "none") for index, span in enumerate(layout)]
    names.append(node_name(len(names), layout[0], "none"))  # a replacement takes its victim's span
    assert len(set(names)) == len(names)


def test_sigterm_ends_the_bench_through_its_cleanup(tmp_path: Path) -> None:
    """``timeout``'s SIGTERM must run the bench's finally (which stops the swarm), not kill the bench alone."""
    marker, ready = tmp_path / "cleaned", tmp_path / "ready"
    script = (
        "import pathlib, signal, time\n"
        "from bench.swarm24 import _exit_on_term\n"
        "signal.signal(signal.SIGTERM, _exit_on_term)\n"
        "try:\n"
        f"    pathlib.Path({str(ready)!r}).touch()\n"
        "    time.sleep(600)\n"
        "finally:\n"
        f"    pathlib.Path({str(marker)!r}).touch()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    process = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    assert marker.exists()


class WordTokenizer:
    """Prompts become three ids; decoding keeps every id, the end token's included (only the ids matter here)."""

    def __call__(self, prompt: str, return_tensors: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=torch.tensor([[3, 4, 5]]))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return " ".join(str(int(i)) for i in ids)


def test_the_reference_goes_on_past_an_end_token_as_ignore_eos_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose greedy choice is always its end token (an all-zero LM head: every logit ties, the first id wins,
    and the end token is id 0): ``ignore_eos`` streams get that token every time (vLLM's meaning, the gateway's), so
    the reference must too, not the second choice that ``min_new_tokens`` leaves once it masks the end token."""
    config = LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, eos_token_id=0
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: WordTokenizer())
    texts = reference_texts(Path("unused/model.gguf"), 4)
    assert set(texts.values()) == {"0 0 0 0"}


def test_the_churn_kills_nodes_that_hold_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Of 20 live nodes one holds the streams' sessions: every kill must hit it (or its like), not a bystander."""
    killed_processes: list[str] = []
    monkeypatch.setattr(swarm24, "kill_tree", lambda process: killed_processes.append(process.peer_id))

    def node(peer_id: str) -> Started:
        process = SimpleNamespace(peer_id=peer_id, popen=SimpleNamespace(poll=lambda: None))
        return Started(cast(ManagedProcess, process), (0, 2), "none", 0.0)

    nodes = [node(f"peer{i}") for i in range(20)]
    kills: list[Kill] = []
    churn(nodes, 3, 0.0, lambda span, quant: node(""), threading.Event(), kills, lambda: {"peer7"})
    assert killed_processes == ["peer7"] * 3  # the fakes never die, so peer7 is drawn every time
    assert [k.carrying for k in kills] == [True] * 3


def test_a_gateway_that_does_not_answer_does_not_stop_the_kills(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swarm24, "kill_tree", lambda process: None)

    def node(peer_id: str) -> Started:
        process = SimpleNamespace(peer_id=peer_id, popen=SimpleNamespace(poll=lambda: None))
        return Started(cast(ManagedProcess, process), (0, 2), "none", 0.0)

    def unanswered() -> set[str]:
        raise httpx.ReadTimeout("timed out")

    kills: list[Kill] = []
    churn([node("a"), node("b")], 2, 0.0, lambda span, quant: node(""), threading.Event(), kills, unanswered)
    assert [k.carrying for k in kills] == [False, False]
