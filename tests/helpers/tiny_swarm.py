"""The tiny llama on a local swarm with blocks 3:6 served twice (a replica to fail over to), and transformers'
greedy tokens for it: what the failover tests of speculative and pipelined decoding compare with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gateway.model.engine import GenerationEngine
from gateway.settings import EngineSettings
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.tiny_models import TinyModel

REPLICATED = ("0:3", "3:6", "3:6")


def greedy_reference(tiny: TinyModel, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return output[0, len(prompt) :].tolist()


def start_for_reference(swarm: LocalSwarm, tiny: TinyModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Starts the replicated swarm of ``tiny``; returns the tokens it must generate from ``prompt`` (transformers')."""
    start_replicated(swarm, tiny.folder)
    return greedy_reference(tiny, prompt, new_tokens)


def start_replicated(swarm: LocalSwarm, folder: Path, *extra: str) -> list[ManagedProcess]:
    """The DHT and the nodes of ``REPLICATED``, not waited for."""
    swarm.start_dht()
    return swarm.start_nodes(folder, REPLICATED, *extra)


def process_of(swarm: LocalSwarm, peer_id: str) -> ManagedProcess:
    return next(node for node in swarm.processes if node.peer_id == peer_id)


async def speculating_engine(swarm: LocalSwarm, folder: Path, **settings: Any) -> GenerationEngine:
    """An engine in this process over the swarm, speculating although loopback's round trip is below the default
    ``speculative_min_rtt``; ``settings`` override the rest."""
    base = EngineSettings(model=str(folder), initial_peers=swarm.initial_peers, num_threads=1, speculative_min_rtt=0.0)
    return await GenerationEngine.create(base.model_copy(update=settings))
