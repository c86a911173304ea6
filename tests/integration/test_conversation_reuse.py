"""Kept conversations over real nodes: a chat's next turn prefills only its new tokens and equals a fresh run.

Two `swarm_node serve` processes hold the tiny Llama (0:3, 3:6) with a 2 s session idle timeout; the engine runs in
the test. What the nodes computed is read from their ``info`` RPC (``tokens_processed``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hivemind.p2p import P2P

from gateway.generation import GeneratedToken, GenerationRequest, PromptCached, SamplingParams
from gateway.model.engine import GenerationEngine
from gateway.settings import EngineSettings
from tests.helpers.node_info import node_infos, wait_all_free
from tests.helpers.processes import LocalSwarm
from tests.tiny_models import GetTinyModel

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_nodes(module_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel) -> LocalSwarm:
    module_swarm.start_dht()
    folder = tiny_with_tokenizer("llama").folder
    module_swarm.start_nodes(folder, ("0:3", "3:6"), "--session-idle-timeout", "2")
    return module_swarm


async def run(engine: GenerationEngine, prompt: list[int], new_tokens: int, scope: str | None) -> tuple[list[int], int]:
    """(generated ids, prompt tokens the nodes held already)."""
    tokens, cached = [], 0
    request = GenerationRequest(prompt, new_tokens, GREEDY, reuse_scope=scope)
    async with contextlib.aclosing(engine.stream(request)) as events:
        async for event in events:
            if isinstance(event, PromptCached):
                cached = event.tokens
            elif isinstance(event, GeneratedToken):
                tokens.append(event.token_id)
    return tokens, cached


async def processed(p2p: P2P, swarm: LocalSwarm) -> list[int]:
    return [info.tokens_processed for info in await node_infos(p2p, swarm)]


async def test_next_turns_reuse_kept_caches_and_fall_back_when_the_nodes_dropped_them(
    tiny_nodes: LocalSwarm, client_p2p: P2P, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("llama")

    def expected(prompt: list[int], new_tokens: int) -> list[int]:
        out = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        return [int(t) for t in out[0, len(prompt) :]]

    settings = EngineSettings(
        model=str(tiny.folder),
        initial_peers=tiny_nodes.initial_peers,
        num_threads=1,
        conversation_keep_alive=60,
        verify_check_rate=0,  # a spot check's forward is node work too: this test counts the nodes' work exactly
    )
    engine = await GenerationEngine.create(settings)
    try:
        for _ in range(100):
            if not (await engine.swarm_view(fresh=True)).missing_blocks():
                break
        turn1 = [5, 17, 99, 3, 42, 8, 1]
        first, cached = await run(engine, turn1, 8, "key")
        assert first == expected(turn1, 8) and cached == 0

        # Turn 2 continues turn 1: the nodes hold its prompt and every generated token but the last (never fed).
        turn2 = [*turn1, *first, 11, 12, 13]
        before = await processed(client_p2p, tiny_nodes)
        second, cached = await run(engine, turn2, 8, "key")
        assert second == expected(turn2, 8)
        assert cached == len(turn1) + len(first) - 1
        after = await processed(client_p2p, tiny_nodes)
        sent = len(turn2) - cached + len(second) - 1  # the new prompt tokens, then each fed generated token
        assert [b - a for a, b in zip(before, after, strict=True)] == [sent] * 2

        # Another scope never sees the conversation; a request without one neither keeps nor reuses.
        assert (await run(engine, [*turn2, *second, 4], 3, "other key"))[1] == 0
        assert (await run(engine, [*turn2, *second, 4], 3, None))[1] == 0

        # The nodes drop the kept sessions after 2 s idle: the next turn quietly prefills everything again.
        infos = await wait_all_free(client_p2p, tiny_nodes, within=30)
        assert all(info.sessions == 0 for info in infos)
        turn3 = [*turn2, *second, 21, 22]
        third, cached = await run(engine, turn3, 6, "key")
        assert cached == 0 and third == expected(turn3, 6)
    finally:
        await engine.close()
