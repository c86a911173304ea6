"""Pipelined verification through real node processes: frames sent ahead on each hop's own stream.

The engine runs in this process with ``speculative_pipeline="always"`` (on loopback the cost model would never
pipeline) and drafts from the known output, every fifth draft wrong, so frames sent ahead are both kept and voided.
Checked: greedy output equals transformers' generate with a node SIGKILLed right after a frame was sent ahead (two
frames in flight: both fail at the dead node, the step goes again unpipelined, fails over and replays the history
in position order), and a grammar-constrained request gives the same tokens pipelined as unpipelined.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from gateway.generation import GenerationRequest, Grammar, SamplingParams
from gateway.model.engine import GenerationEngine
from gateway.swarm.chain_session import ChainSession
from gateway.swarm.frames import Frame
from tests.helpers.processes import LocalSwarm
from tests.helpers.tiny_swarm import process_of, speculating_engine, start_for_reference
from tests.integration.test_churn import start_nodes
from tests.integration.test_engine_chain import _wait_covered, engine_settings
from tests.tiny_models import _COMMON, GetTinyModel
from tests.unit.gateway.model.test_speculative_engine import PROMPT, OracleDrafts

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

NEW_TOKENS = 40
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Recorder:
    """The engine's chains, with every frame they sent (and, once, a node killed right after a frame ahead)."""

    def __init__(self, engine: GenerationEngine, reference: list[int], kill: Any = None) -> None:
        self.chains: list[ChainSession] = []
        self.ahead = 0  # frames sent ahead of another
        self.kill = kill  # called with the chain once, right after the third frame ahead leaves
        prefill, make_drafter = engine._prefill, engine._drafter

        async def prefilled(request: GenerationRequest) -> tuple[ChainSession, torch.Tensor, int]:
            opened = await prefill(request)
            self._watch(opened[0])
            return opened

        def drafter(request: GenerationRequest) -> OracleDrafts:
            made = make_drafter(request)
            assert made is not None
            return OracleDrafts(request.prompt_ids, made.tuner, reference)

        engine._prefill = prefilled  # type: ignore[method-assign]
        engine._drafter = drafter  # type: ignore[method-assign]

    def _watch(self, chain: ChainSession) -> None:
        self.chains.append(chain)
        send = chain.frame

        def frame(hidden: torch.Tensor, position: int, ahead: bool = False) -> Frame:
            sent = send(hidden, position, ahead)
            self.ahead += ahead
            if ahead and self.ahead == 3 and self.kill is not None:
                self.kill(chain)  # the frame before this one is in flight too
                self.kill = None
            return sent

        chain.frame = frame  # type: ignore[method-assign]


async def generate(engine: GenerationEngine, request: GenerationRequest) -> list[int]:
    return [token async for token in engine.generate(request)]


async def test_a_node_killed_with_two_frames_in_flight_is_replaced_with_the_same_tokens(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("llama")
    expected = start_for_reference(local_swarm, tiny, PROMPT, NEW_TOKENS)
    engine = await speculating_engine(local_swarm, tiny.folder, speculative_pipeline="always")
    victims: list[str] = []

    def kill(chain: ChainSession) -> None:
        victims.append(chain.hops[-1].peer_id)
        process_of(local_swarm, victims[0]).send(signal.SIGKILL)

    recorder = Recorder(engine, expected, kill)
    try:
        await _wait_covered(engine)
        request = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0))
        tokens: list[int] = []
        last_hops: list[str] = []
        async for token in engine.generate(request):
            tokens.append(token)
            last_hops = [hop.peer_id for hop in recorder.chains[0].hops]  # the chain closes after the last token
        assert tokens == expected
        assert victims and victims[0] not in last_hops and len(last_hops) == 2
        assert recorder.chains[0].failovers == 1
        assert recorder.ahead > 3  # frames went on being sent ahead after the failover
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def smol_vocab(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama whose vocabulary is SmolLM2's (llguidance compiles real schemas against it)."""
    path = tmp_path_factory.mktemp("tiny-smol-vocab")
    torch.manual_seed(3)
    config = LlamaConfig(**{**_COMMON, "vocab_size": 49152, "initializer_range": 0.05}, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(path)
    AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name).save_pretrained(path)
    return path


async def test_a_grammar_constrained_request_gives_the_same_tokens_pipelined(
    local_swarm: LocalSwarm, smol_vocab: Path
) -> None:
    local_swarm.start_dht()
    start_nodes(local_swarm, smol_vocab, ["0:3", "3:6"])
    base = engine_settings(smol_vocab, local_swarm).model_copy(update={"speculative_min_rtt": 0.0})
    prompt = [1, 504, 2503, 314, 253, 1378, 28, 2]
    request = GenerationRequest(
        prompt, NEW_TOKENS, SamplingParams(temperature=0.0), grammar=Grammar("json_schema", json.dumps(SCHEMA))
    )
    outputs: list[list[int]] = []
    recorders: list[Recorder] = []
    reference: list[int] = []
    for pipeline in ("off", "always"):
        engine = await GenerationEngine.create(base.model_copy(update={"speculative_pipeline": pipeline}))
        try:
            await _wait_covered(engine)
            recorders.append(Recorder(engine, reference))
            outputs.append(await generate(engine, request))
            reference.extend(outputs[0] if not reference else [])
        finally:
            await engine.close()
    assert outputs[1] == outputs[0]
    assert recorders[1].ahead > 2 and recorders[0].ahead == 0
