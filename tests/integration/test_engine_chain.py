"""The gateway's engine over real node processes equals transformers' own generate, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.model.engine import GenerationEngine, GenerationRequest
from gateway.model.sampling import SamplingParams
from gateway.settings import EngineSettings
from shared.errors import MissingBlocks
from tests.helpers.processes import LocalSwarm
from tests.helpers.smollm2 import start_smollm2_swarm
from tests.tiny_models import GetTinyModel

pytestmark = pytest.mark.timeout(600)


def engine_settings(model: Path | str, swarm: LocalSwarm) -> EngineSettings:
    return EngineSettings(model=str(model), initial_peers=swarm.initial_peers, num_threads=1)


async def test_tiny_qwen3_across_three_nodes_matches_generate(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("qwen3")
    local_swarm.start_dht()
    nodes = local_swarm.start_nodes(tiny.folder, ("0:2", "2:5", "5:6"))
    engine = await GenerationEngine.create(engine_settings(tiny.folder, local_swarm))
    try:
        await _wait_covered(engine)
        prompt = [5, 17, 99, 3, 42, 8, 1]
        expected = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, 7:].tolist()
        request = GenerationRequest(prompt, 20, SamplingParams(temperature=0.0))
        assert [token async for token in engine.generate(request)] == expected

        # Seeded sampling is reproducible and stays inside the vocabulary.
        sampled = GenerationRequest(prompt, 12, SamplingParams(temperature=0.8, top_p=0.9, seed=7))
        first = [token async for token in engine.generate(sampled)]
        second = [token async for token in engine.generate(sampled)]
        assert first == second and all(0 <= t < 128 for t in first)

        # A gap in coverage fails loudly, naming the missing blocks.
        nodes[1].stop()
        view = await engine.swarm_view(fresh=True)
        for _ in range(50):
            if view.missing_blocks():
                break
            view = await engine.swarm_view(fresh=True)
        assert view.missing_blocks() == [2, 3, 4]
        with pytest.raises(MissingBlocks, match="2:5"):
            [token async for token in engine.generate(request)]
    finally:
        await engine.close()


async def _wait_covered(engine: GenerationEngine) -> None:
    for _ in range(100):
        if not (await engine.swarm_view(fresh=True)).missing_blocks():
            return
    raise AssertionError("the swarm never covered every block")


@pytest.mark.slow
async def test_smollm2_two_nodes_match_transformers_generate(local_swarm: LocalSwarm, smollm2_gguf: Path) -> None:
    reference, tokenizer = start_smollm2_swarm(local_swarm, smollm2_gguf)
    engine = await GenerationEngine.create(engine_settings(smollm2_gguf, local_swarm))
    try:
        await _wait_covered(engine)
        prompts = [
            "The capital of France is",
            "def fibonacci(n):",
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "Name three colours."}], tokenize=False, add_generation_prompt=True
            ),
        ]
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                expected = reference.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
            request = GenerationRequest(ids[0].tolist(), 32, SamplingParams(temperature=0.0))
            got = [token async for token in engine.generate(request)]
            assert got == expected, (prompt, tokenizer.decode(got), tokenizer.decode(expected))
    finally:
        await engine.close()
