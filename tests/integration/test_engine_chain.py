"""The gateway's engine over real node processes equals transformers' own generate, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from gateway.metrics import GatewayMetrics, current_metrics
from gateway.model.engine import GenerationEngine, GenerationRequest
from gateway.model.sampling import SamplingParams
from gateway.settings import EngineSettings
from shared.errors import MissingBlocks
from tests.helpers.processes import LocalSwarm
from tests.helpers.smollm2 import load_reference
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
async def test_smollm2_two_nodes_match_transformers_generate(smollm2_swarm: LocalSwarm, smollm2_gguf: Path) -> None:
    reference, tokenizer = load_reference(smollm2_gguf)
    engine = await GenerationEngine.create(engine_settings(smollm2_gguf, smollm2_swarm))
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
    await _speculative_greedy_equals_generate(smollm2_swarm, smollm2_gguf, reference, tokenizer)


COPY_PROMPT = (
    "Rewrite the paragraph below, changing the word 'river' to 'stream' and nothing else.\n\n"
    "The old mill stood beside the river for two hundred years. Every morning the miller opened the doors, "
    "fed the fire and listened to the river turning the great wheel. Children from the village came to watch "
    "the flour pour into the sacks, and in the evening the river carried the last light down the valley."
)


async def _speculative_greedy_equals_generate(
    swarm: LocalSwarm, gguf: Path, reference: torch.nn.Module, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Prompt-lookup speculation through the real nodes (drafting even on loopback): a copy-heavy prompt's greedy
    tokens equal transformers' generate, and the spec metrics counted drafts the model accepted."""
    settings = engine_settings(gguf, swarm).model_copy(update={"speculative": "ngram", "speculative_min_rtt": 0.0})
    engine = await GenerationEngine.create(settings)
    metrics = GatewayMetrics()
    current_metrics.set(metrics)
    try:
        await _wait_covered(engine)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": COPY_PROMPT}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :].tolist()  # type: ignore[operator]
        request = GenerationRequest(ids[0].tolist(), 48, SamplingParams(temperature=0.0), reuse_scope="spec")
        got = [token async for token in engine.generate(request)]
        assert got == expected, (tokenizer.decode(got), tokenizer.decode(expected))
        accepted = metrics.spec_accepted._value.get()
        assert 0 < accepted <= metrics.spec_draft._value.get()
    finally:
        await engine.close()
