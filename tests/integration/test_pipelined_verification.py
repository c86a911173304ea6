"""Pipelined verification through real node processes: frames sent ahead on each hop's own stream.

The engine runs in this process with ``speculative_pipeline="always"`` (on loopback the cost model would never
pipeline) and drafts from the known output, every fifth draft wrong, so frames sent ahead are both kept and voided.
Checked: greedy output equals transformers' generate with a node SIGKILLed right after a frame was sent ahead (two
frames in flight: both fail at the dead node, the step goes again unpipelined, fails over and replays the history
in position order), and a grammar-constrained request gives the same tokens pipelined as unpipelined. Through a real
gateway (``--speculative-pipeline always``) and the openai client: a node frozen mid-stream with frames in flight is
replaced (at once: the frames found it frozen) and the stream ends as an unfrozen one does.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P
from openai.types.chat import ChatCompletionChunk
from transformers import AutoModelForCausalLM, LlamaConfig

from gateway.generation import GenerationRequest, Grammar, SamplingParams
from gateway.model.engine import GenerationEngine
from gateway.swarm.chain_session import ChainSession
from gateway.swarm.frames import Frame
from shared.rpc_client import fetch_info
from tests.helpers.gateway import start_gateway
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.helpers.smollm2 import load_tokenizer
from tests.helpers.tiny_swarm import process_of, speculating_engine, start_for_reference, start_replicated
from tests.integration.conftest import client_peer
from tests.integration.test_engine_chain import _wait_covered, engine_settings
from tests.tiny_models import _COMMON, GetTinyModel, TinyModel
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
    load_tokenizer(smollm2_gguf).save_pretrained(path)
    return path


async def test_a_grammar_constrained_request_gives_the_same_tokens_pipelined(
    local_swarm: LocalSwarm, smol_vocab: Path
) -> None:
    local_swarm.start_dht()
    local_swarm.start_nodes(smol_vocab, ["0:3", "3:6"])
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


FROZEN_TOKENS = 600  # long enough that the freeze lands well before the end, on a loaded machine too
# Repeats itself: the default (ngram) drafts from it, so rounds draft and frames are sent ahead from the start.
CHAT = "t5 t17 t99 t3 t42 t8 t1 t64 t2 t77 t5 t17 t99 t3 t42 t8 t1 t64"


@dataclass
class Streamed:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk, the stream's last before [DONE]

    def read(self, chunk: ChatCompletionChunk) -> None:
        for choice in chunk.choices:
            self.text += choice.delta.content or ""
            self.finish_reason = choice.finish_reason or self.finish_reason
        if chunk.usage is not None:
            self.completion_tokens = chunk.usage.completion_tokens


async def route_node(p2p: P2P, replicas: list[ManagedProcess]) -> ManagedProcess:
    """The one of ``replicas`` (nodes of the same span) that holds a session: the stream's route goes through it."""
    sessions = [(await fetch_info(p2p, node.peer_id, 10.0))[0].sessions for node in replicas]
    assert sorted(sessions) == [0, 1], sessions
    return replicas[sessions.index(1)]


async def test_a_node_frozen_mid_stream_with_frames_ahead_is_replaced_for_the_openai_client(
    local_swarm: LocalSwarm, chat_model: TinyModel
) -> None:
    """A real gateway pipelining always (frames ahead whenever a round drafts), the openai client streaming a greedy
    chat; the route's node of blocks 3:6 is frozen (SIGSTOP, its p2pd too, as a machine that hangs) once the first
    tokens arrive, and stays frozen. The stream goes on through the other replica of 3:6 and ends as an unfrozen run
    of the same request does: the same text, finish_reason ``length``, the usage chunk."""
    nodes = start_replicated(local_swarm, chat_model.folder)
    for node in nodes:  # both replicas of 3:6 announced: the replacement is there when the freeze comes
        local_swarm.wait_serving(node)
    # --no-verify: a spot check's session on the other replica would hide which node the route goes through.
    flags = ["--speculative-pipeline", "always", "--speculative-min-rtt", "0", "--no-verify"]
    gateway = start_gateway(local_swarm, chat_model.folder, *flags)
    client = gateway.async_openai()
    request: dict[str, Any] = {
        "model": gateway.model,
        "messages": [{"role": "user", "content": CHAT}],
        "max_tokens": FROZEN_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    reference, frozen, streamed = Streamed(), None, Streamed()
    async for chunk in await client.chat.completions.create(**request):
        reference.read(chunk)
    async with client_peer(local_swarm.initial_peers) as p2p:
        try:
            async for chunk in await client.chat.completions.create(**request):
                streamed.read(chunk)
                if frozen is None and streamed.text:  # under way (the gateway is some tokens ahead of the client)
                    frozen = await route_node(p2p, nodes[1:])
                    frozen.send(signal.SIGSTOP)
        finally:
            if frozen is not None:
                frozen.send(signal.SIGCONT)
    await client.close()
    logs = gateway.log_text()[-3000:]
    assert reference.finish_reason == "length" and reference.completion_tokens == FROZEN_TOKENS, (reference, logs)
    assert streamed == reference, (streamed, reference, logs)
    with gateway.http() as http:
        counters = http.get("/v1/swarm").json()["counters"]
    assert frozen is not None and counters["failovers"] == 1, (counters, logs)  # the freeze hit the generation
    assert "a pipelined frame at" in logs and frozen.peer_id in logs, logs  # frames were in flight at the node
    # ... and found it frozen: the step sent again fails it over at once, no second wait on the frozen node
    assert "lost its stream" in logs, logs
