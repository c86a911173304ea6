"""Every family added for issue 17 through real node processes equals transformers' own generate, token for token.

Per family: two nodes (blocks 0:3 and 3:6) of its tiny random model on the module's DHT, the gateway's engine on
top; two prompts generated at once (their decode steps share the nodes' batched forwards) each equal ``generate``
alone.
One family (Mixtral: experts inside the span) also survives the SIGKILL of the node carrying its second half.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from gateway.model.engine import GenerationEngine, GenerationRequest
from gateway.model.sampling import SamplingParams
from tests.helpers.processes import LocalSwarm
from tests.integration.test_churn import Client
from tests.integration.test_engine_chain import _wait_covered, engine_settings
from tests.tiny_models import GetTinyModel

pytestmark = pytest.mark.timeout(600)

NEW_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "falcon", "falcon_new", "bloom", "gemma2", "gemma3", "phi3"]
PROMPTS = [[5, 17, 99, 3, 42, 8, 1], [64, 2, 77, 31, 120, 9, 9, 50, 11, 6, 3]]  # the second outgrows the windows
NEW_TOKENS = 20


def reference(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)  # type: ignore[operator]
    return [int(t) for t in output[0, len(prompt) :]]


@pytest.fixture(scope="module")
def families_dht(module_swarm: LocalSwarm) -> LocalSwarm:
    """One DHT for the families' tests (a process's start is seconds of this machine's CPU): each family's tiny model
    has a name of its own there, so no test sees another's nodes."""
    module_swarm.start_dht()
    return module_swarm


@pytest.mark.parametrize("variant", NEW_FAMILIES)
async def test_two_nodes_generate_what_transformers_generates(
    local_swarm: LocalSwarm, families_dht: LocalSwarm, tiny_with_tokenizer: GetTinyModel, variant: str
) -> None:
    tiny = tiny_with_tokenizer(variant)
    local_swarm.initial_peers = list(families_dht.initial_peers)  # the test's own nodes, killed when it ends
    local_swarm.start_nodes(tiny.folder, ["0:3", "3:6"])
    engine = await GenerationEngine.create(engine_settings(tiny.folder, local_swarm))
    try:
        await _wait_covered(engine)

        async def generate(prompt: list[int]) -> list[int]:
            request = GenerationRequest(prompt, NEW_TOKENS, SamplingParams(temperature=0.0))
            return [token async for token in engine.generate(request)]

        got = await asyncio.gather(*(generate(prompt) for prompt in PROMPTS))
        assert got == [reference(tiny.model, prompt) for prompt in PROMPTS]
    finally:
        await engine.close()


async def test_mixtral_failover_replays_exactly(local_swarm: LocalSwarm, tiny_model: GetTinyModel) -> None:
    tiny = tiny_model("mixtral")
    local_swarm.start_dht()
    local_swarm.start_nodes(tiny.folder, ["0:3", "3:6", "3:6"])
    async with Client(tiny.folder, local_swarm) as client:
        await client.wait_for("every block is covered", lambda s: len(s) == 3)
        prompt = PROMPTS[1]
        async with client.session(64) as chain:
            tokens: list[int] = []
            async for token in client.greedy(prompt, NEW_TOKENS, chain):
                tokens.append(token)
                if len(tokens) == 8:
                    victim_peer = chain.hops[-1].peer_id
                    victim = next(p for p in local_swarm.processes if p.peer_id == victim_peer)
                    victim.send(signal.SIGKILL)
            assert chain.failovers == 1 and chain.hops[-1].peer_id != victim_peer
        assert tokens == reference(tiny.model, prompt)
