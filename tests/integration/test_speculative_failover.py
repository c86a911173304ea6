"""Speculative decoding through real nodes survives the SIGKILL of a node mid-generation with the same tokens.

Three nodes of the tiny llama (0:3, 3:6, 3:6); the engine verifies drafts (some wrong, so some rounds roll back)
and the node carrying blocks 3:6 is killed after a few tokens: its replacement is replayed the inputs the lost node
had, rejected drafts left out, and greedy output still equals transformers' generate.
"""

from __future__ import annotations

import signal

import pytest
import torch

from gateway.generation import GenerationRequest, SamplingParams
from gateway.metrics import GatewayMetrics, current_metrics
from gateway.model.engine import GenerationEngine
from gateway.model.speculation import PromptLookup
from gateway.swarm.chain_session import ChainSession
from tests.helpers.processes import LocalSwarm
from tests.helpers.tiny_swarm import process_of, speculating_engine, start_for_reference
from tests.integration.test_engine_chain import _wait_covered
from tests.tiny_models import GetTinyModel
from tests.unit.gateway.model.test_speculative_engine import PROMPT, OracleDrafts

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

NEW_TOKENS = 30


async def test_a_node_killed_mid_speculation_is_replaced_with_the_same_tokens(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("llama")
    expected = start_for_reference(local_swarm, tiny, PROMPT, NEW_TOKENS)
    engine = await speculating_engine(local_swarm, tiny.folder)
    drafters: list[PromptLookup] = []

    def oracle(request: GenerationRequest) -> OracleDrafts:  # drafts from the known output, every fifth one wrong
        drafter = GenerationEngine._drafter(engine, request)
        assert drafter is not None
        drafters.append(OracleDrafts(request.prompt_ids, drafter.tuner, expected))
        return drafters[-1]

    engine._drafter = oracle  # type: ignore[method-assign]
    chains: list[ChainSession] = []
    prefill = engine._prefill

    async def keep_chain(request: GenerationRequest) -> tuple[ChainSession, torch.Tensor, int]:
        opened = await prefill(request)
        chains.append(opened[0])
        return opened

    engine._prefill = keep_chain  # type: ignore[method-assign]
    metrics = GatewayMetrics()
    current_metrics.set(metrics)
    try:
        await _wait_covered(engine)
        request = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0))
        tokens: list[int] = []
        victim = None
        async for token in engine.generate(request):
            tokens.append(token)
            if victim is None and len(tokens) >= 8:
                victim = chains[0].hops[-1].peer_id
                process_of(local_swarm, victim).send(signal.SIGKILL)
            last_hops = [hop.peer_id for hop in chains[0].hops]  # the chain closes after the last token
        assert tokens == expected
        assert chains[0].failovers == 1 and victim not in last_hops and len(last_hops) == 2
        assert 0 < metrics.spec_accepted._value.get() < metrics.spec_draft._value.get()
    finally:
        await engine.close()
