"""SmolLM2 on two local nodes (blocks 0:15 and 15:30) and transformers' own model of it: the exactness reference."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tests.helpers.polling import wait_until
from tests.helpers.processes import LocalSwarm
from tests.helpers.prometheus import node_url, scrape, value
from tests.helpers.redis_server import free_port

SPANS = ("0:15", "15:30")
Reference = tuple[PreTrainedModel, PreTrainedTokenizerBase]


@dataclass
class SmolLM2Nodes:
    """A DHT and SmolLM2's two nodes (``SPANS``, each with a Prometheus metrics port), serving."""

    swarm: LocalSwarm
    metrics_ports: list[int]

    def wait_idle(self, within: float = 60.0) -> None:
        """Until both nodes still run and hold no session: the gateways of the module before have closed theirs."""

        def idle() -> bool:
            for node in self.swarm.serving_nodes():
                if node.popen.poll() is not None:
                    raise RuntimeError(f"{node.name} exited with {node.popen.returncode}:\n{node.log_text()[-3000:]}")
            return all(_sessions_open(port) == 0 for port in self.metrics_ports)

        wait_until(idle, within, state=lambda: [_sessions_open(port) for port in self.metrics_ports])


def start_smollm2_nodes(swarm: LocalSwarm, gguf: Path) -> SmolLM2Nodes:
    swarm.start_dht()
    ports = [free_port() for _ in SPANS]
    nodes = [swarm.start_node(gguf, span, "--metrics-port", str(port)) for span, port in zip(SPANS, ports, strict=True)]
    for node in nodes:
        swarm.wait_serving(node)
    return SmolLM2Nodes(swarm, ports)


def _sessions_open(port: int) -> float:
    return value(scrape(node_url(port)), "swarmgate_node_sessions_open")


def load_reference(gguf: Path) -> Reference:
    """transformers' whole model of the GGUF file (dequantized to float32) and its tokenizer.

    transformers dequantizes a GGUF file in Python, some 30 CPU seconds for SmolLM2 (and reads its tokenizer from
    the file's metadata, 5 more), and a dozen test modules on two xdist workers want the same model: the first to
    ask stores what transformers built (its config, generation config and weights as safetensors: the exact float32
    tensors) under the system's temporary folder, keyed by the file and the transformers and torch versions, and the
    rest load that folder in about a second. Not the pickled module: transformers 5.24 installs the hooks that capture
    ``hidden_states`` at the first forward, and a module pickled before it comes back believing them installed (its
    outputs then carry no hidden states); nor ``save_pretrained``, which refuses a model loaded from a GGUF file."""
    stored = _stored(gguf, "model")
    with _alone(stored):
        if not stored.exists():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            partial = stored.with_suffix(".partial")
            shutil.rmtree(partial, ignore_errors=True)
            # its tensors are float32 already: the GGUF file's quantization_config does not describe them
            config = {key: value for key, value in model.config.to_dict().items() if key != "quantization_config"}
            AutoConfig.for_model(**config).save_pretrained(partial)
            model.generation_config.save_pretrained(partial)
            save_model(model, str(partial / "model.safetensors"))  # the tied embedding and LM head once
            os.replace(partial, stored)  # whole or not at all, as ``_store``
    model = AutoModelForCausalLM.from_pretrained(stored, dtype=torch.float32)
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
