"""SmolLM2 on two local nodes (blocks 0:15 and 15:30) and transformers' own model of it: the exactness reference."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tests.helpers.processes import LocalSwarm

SPANS = ("0:15", "15:30")
Reference = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def start_smollm2_swarm(swarm: LocalSwarm, gguf: Path) -> Reference:
    """A DHT and the two nodes, serving once this returns; the reference loads while the nodes do."""
    swarm.start_dht()
    nodes = [swarm.start_node(gguf, span) for span in SPANS]
    reference = load_reference(gguf)
    for node in nodes:
        swarm.wait_serving(node)
    return reference


def load_reference(gguf: Path) -> Reference:
    """transformers' whole model of the GGUF file (dequantized to float32) and its tokenizer.

    transformers dequantizes a GGUF file in Python, some 30 CPU seconds for SmolLM2 (and reads its tokenizer from
    the file's metadata, 5 more), and a dozen test modules on two xdist workers want the same model: the first to
    ask stores what transformers built (``torch.save``, the exact tensors) under the system's temporary folder, keyed
    by the file and the transformers and torch versions, and the rest read that back in about a second."""
    stored = _stored(gguf, "model.pt")
    with _alone(stored):
        if not stored.exists():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            _store(model, stored)
    model = torch.load(stored, weights_only=False)
    return model.eval(), load_tokenizer(gguf)


def load_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of the GGUF file (stored once as ``load_reference`` stores the model)."""
    stored = _stored(gguf, "tokenizer.pt")
    with _alone(stored):
        if not stored.exists():
            _store(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), stored)
    tokenizer: PreTrainedTokenizerBase = torch.load(stored, weights_only=False)
    return tokenizer


def _stored(gguf: Path, name: str) -> Path:
    status = gguf.stat()
    versions = f"transformers{transformers.__version__}-torch{torch.__version__}"
    key = f"{gguf.stem}-{status.st_size}-{status.st_mtime_ns}-{versions}"
    folder = Path(tempfile.gettempdir()) / "swarmgate-test-references" / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


@contextmanager
def _alone(path: Path) -> Iterator[None]:
    """Holds ``path``'s lock file: the other xdist worker waits for the file rather than building it too."""
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _store(value: object, path: Path) -> None:
    """Written whole or not at all: a run killed mid-write leaves no file a later run would read."""
    partial = path.with_suffix(".partial")
    torch.save(value, partial)
    os.replace(partial, path)
