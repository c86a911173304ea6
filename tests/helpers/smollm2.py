"""SmolLM2 on two local nodes (blocks 0:15 and 15:30) and transformers' own model of it: the exactness reference."""

from __future__ import annotations

from pathlib import Path

import torch
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
    """transformers' whole model of the GGUF file (dequantized to float32) and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
