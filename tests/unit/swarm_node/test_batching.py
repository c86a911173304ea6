"""Batched decode across sessions and chunked prefill on in-process backends: the same tokens as each session alone.

Two backends (blocks 0:3 and 3:6 of a tiny model, as two nodes would hold them) and the model's head run greedy
generation for several sessions at once; their decode steps meet in the batchers and run as batched forwards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

import pytest
import torch
from hivemind.p2p import P2P

from gateway.model.head import ModelHead, build_head
from shared.arrival_forecast import ArrivalForecast
from shared.model_source import load_config, resolve_model
from shared.weights import open_weights
from shared.wire import BatchRow, NextHop
from swarm_node.backend import SpanBackend
from swarm_node.cache_pool import CachePool
from swarm_node.decode_batcher import BatchPolicy
from swarm_node.kv_cache import SessionKV
from swarm_node.push import PushLinks, run_rows
from swarm_node.quantize import block_transform
from swarm_node.sessions import Session
from swarm_node.span import build_span
from tests.tiny_models import VOCAB, GetTinyModel

NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 17, 8, 11, 5)
SPANS = ((0, 3), (3, 6))  # sessions at different positions all the time


@dataclass
class Chain:
    head: ModelHead
    backends: list[SpanBackend]

    async def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Prefill, then one decode step per token through every backend (batched with whoever else steps)."""
        kvs = [await b.new_session_kv(range(b.span.start, b.span.end), 64) for b in self.backends]
        ids, position, tokens = prompt, 0, []
        for _ in range(new_tokens):
            hidden = self.head.embed(torch.tensor([ids]))
            for backend, kv in zip(self.backends, kvs, strict=True):
                hidden = await backend.serve_step(kv, hidden, position)
            tokens.append(int(self.head.logits(hidden)[0, -1].argmax()))
            position += len(ids)
            ids = tokens[-1:]
        return tokens


ChainFactory = Callable[[BatchPolicy], "Chain"]


@pytest.fixture(params=["llama", "qwen2"])  # qwen2: sliding-window layers in the ragged attention
async def chain_factory(request: pytest.FixtureRequest, tiny_model: GetTinyModel) -> AsyncIterator[ChainFactory]:
    tiny = tiny_model(request.param)
    source = resolve_model(str(tiny.folder))
    config = load_config(source)
    built: list[SpanBackend] = []

    def make(policy: BatchPolicy) -> Chain:
        reader = open_weights(source, config)
        node_layout = block_transform("none", torch.float32, torch.device("cpu"))  # what a CPU node serves
        backends = [SpanBackend(build_span(config, reader, s, e, transform=node_layout), policy) for s, e in SPANS]
        built.extend(backends)
        return Chain(build_head(config, reader), backends)

    yield make
    for backend in built:
        backend.shutdown()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


async def test_concurrent_sessions_decode_in_batches_with_the_tokens_each_gets_alone(
    chain_factory: ChainFactory,
) -> None:
    chain = chain_factory(BatchPolicy(window=0.05))
    alone = [await chain.greedy(prompt, NEW_TOKENS) for prompt in prompts()]
    assert all(size == 1 for backend in chain.backends for size in backend.batcher.batch_sizes)
    for backend in chain.backends:
        backend.batcher.batch_sizes.clear()

    together = await asyncio.gather(*(chain.greedy(prompt, NEW_TOKENS) for prompt in prompts()))
    assert list(together) == alone
    for backend in chain.backends:
        sizes = list(backend.batcher.batch_sizes)
        assert sum(sizes) == len(PROMPT_LENGTHS) * (NEW_TOKENS - 1)  # every decode step ran exactly once
        assert max(sizes) > 1  # ... and the sessions' steps really shared forwards


async def test_steps_arriving_together_run_as_one_forward_equal_to_each_alone(chain_factory: ChainFactory) -> None:
    chain = chain_factory(BatchPolicy())
    backend = chain.backends[0]
    hidden_size = chain.head.embed_tokens.embedding_dim
    generator = torch.Generator().manual_seed(3)
    contexts = [torch.randn(1, length, hidden_size, generator=generator) for length in PROMPT_LENGTHS]
    steps = [torch.randn(1, 1, hidden_size, generator=generator) for _ in PROMPT_LENGTHS]

    async def prefilled() -> list[SessionKV]:
        kvs = [await backend.new_session_kv(range(0, 3), 32) for _ in contexts]
        for kv, context in zip(kvs, contexts, strict=True):
            await backend.serve_step(kv, context, 0)
        return kvs

    kvs = await prefilled()
    alone = [await backend.serve_step(kv, step, kv.length) for kv, step in zip(kvs, steps, strict=True)]
    kvs = await prefilled()
    backend.batcher.batch_sizes.clear()
    together = await asyncio.gather(*(backend.serve_step(kv, s, kv.length) for kv, s in zip(kvs, steps, strict=True)))
    assert list(backend.batcher.batch_sizes) == [len(PROMPT_LENGTHS)]
    for got, expected in zip(together, alone, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert [kv.length for kv in kvs] == [length + 1 for length in PROMPT_LENGTHS]


async def test_verify_rows_ride_in_one_forward_with_decode_rows_equal_to_each_alone(
    chain_factory: ChainFactory,
) -> None:
    """Rows of a batch step of different lengths (decode steps of one token, speculative verify steps of several,
    one of them rewinding over rejected drafts) run as one forward; each row's output and the keys/values it leaves
    are what it gets alone."""
    chain = chain_factory(BatchPolicy())
    backend = chain.backends[0]
    hidden_size = chain.head.embed_tokens.embedding_dim
    generator = torch.Generator().manual_seed(4)
    contexts = [torch.randn(1, length, hidden_size, generator=generator) for length in PROMPT_LENGTHS]
    row_tokens = (1, 5, 1, 3, 9)
    rows = [torch.randn(1, tokens, hidden_size, generator=generator) for tokens in row_tokens]
    rewind = (0, 0, 0, 2, 0)  # row 3 steps from two tokens before its session's end
    follow = torch.randn(1, 1, hidden_size, generator=generator)

    async def run(together: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        kvs = [await backend.new_session_kv(range(0, 3), 32) for _ in contexts]
        for kv, context in zip(kvs, contexts, strict=True):
            await backend.serve_step(kv, context, 0)
        starts = [kv.length - back for kv, back in zip(kvs, rewind, strict=True)]
        if together:
            steps = [backend.serve_step(kv, row, s, decode=True) for kv, row, s in zip(kvs, rows, starts, strict=True)]
            outputs = list(await asyncio.gather(*steps))
        else:  # each alone, as an inference stream's step runs it
            outputs = [await backend.step(kv, row, s) for kv, row, s in zip(kvs, rows, starts, strict=True)]
        assert [kv.length for kv in kvs] == [s + r.shape[1] for s, r in zip(starts, rows, strict=True)]
        after = [await backend.serve_step(kv, follow, kv.length) for kv in kvs]
        return outputs, after

    alone = await run(together=False)
    backend.batcher.batch_sizes.clear()
    together = await run(together=True)
    assert backend.batcher.batch_sizes[0] == len(PROMPT_LENGTHS)  # every row in one decode forward
    for got, expected in zip(together[0] + together[1], alone[0] + alone[1], strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


async def test_prompts_arriving_together_prefill_as_one_padded_forward_equal_to_each_alone(
    chain_factory: ChainFactory,
) -> None:
    chain = chain_factory(BatchPolicy())
    backend = chain.backends[0]
    hidden_size = chain.head.embed_tokens.embedding_dim
    generator = torch.Generator().manual_seed(5)
    contexts = [torch.randn(1, length, hidden_size, generator=generator) for length in PROMPT_LENGTHS]
    starts = [0, 0, 2, 0, 1]  # some rows continue a session (a later turn's new tokens)
    follow = torch.randn(1, 1, hidden_size, generator=generator)

    async def run(together: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        kvs = [await backend.new_session_kv(range(0, 3), 32) for _ in contexts]
        for kv, start in zip(kvs, starts, strict=True):
            if start:
                await backend.serve_step(kv, torch.randn(1, start, hidden_size, generator=torch.Generator()), 0)
        steps = [backend.serve_step(kv, c, s) for kv, c, s in zip(kvs, contexts, starts, strict=True)]
        outputs = list(await asyncio.gather(*steps)) if together else [await step for step in steps]
        assert [kv.length for kv in kvs] == [s + c.shape[1] for s, c in zip(starts, contexts, strict=True)]
        after = [await backend.serve_step(kv, follow, kv.length) for kv in kvs]  # the caches hold what they should
        return outputs, after

    backend.prefills.batch_sizes.clear()
    alone = await run(together=False)
    assert set(backend.prefills.batch_sizes) == {1}
    backend.prefills.batch_sizes.clear()
    together = await run(together=True)
    assert backend.prefills.batch_sizes[-1] == len(PROMPT_LENGTHS)  # queued together: one forward
    for got, expected in zip(together[0] + together[1], alone[0] + alone[1], strict=True):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


async def test_a_padded_prefill_stays_within_its_token_bound(chain_factory: ChainFactory) -> None:
    chain = chain_factory(BatchPolicy(prefill_chunk=20))
    backend = chain.backends[0]
    hidden_size = chain.head.embed_tokens.embedding_dim
    kvs = [await backend.new_session_kv(range(0, 3), 32) for _ in range(6)]
    prompts_ = [torch.randn(1, 9, hidden_size) for _ in kvs]  # at most two rows of 9 fit in 20 padded tokens
    backend.prefills.batch_sizes.clear()
    await asyncio.gather(*(backend.serve_step(kv, p, 0) for kv, p in zip(kvs, prompts_, strict=True)))
    assert list(backend.prefills.batch_sizes) == [2, 2, 2]
    assert all(kv.length == 9 for kv in kvs)


async def test_a_lone_session_never_waits_for_the_window(chain_factory: ChainFactory) -> None:
    chain = chain_factory(BatchPolicy(window=60.0))
    began = time.monotonic()
    await chain.greedy(prompts()[0], 6)
    assert time.monotonic() - began < 30  # five decode steps per backend: any wait for the window would take minutes


async def test_batches_never_exceed_the_largest_batch(chain_factory: ChainFactory) -> None:
    chain = chain_factory(BatchPolicy(window=0.05, max_batch=2))
    expected = [await chain.greedy(prompt, 4) for prompt in prompts()]
    assert list(await asyncio.gather(*(chain.greedy(prompt, 4) for prompt in prompts()))) == expected
    assert max(chain.backends[0].batcher.batch_sizes) == 2


async def test_long_prompts_prefill_in_chunks_with_the_same_result(chain_factory: ChainFactory) -> None:
    whole, chunked = chain_factory(BatchPolicy(prefill_chunk=512)), chain_factory(BatchPolicy(prefill_chunk=4))
    prompt = torch.randn(1, 23, whole.head.embed_tokens.embedding_dim)
    outputs = []
    for chain in (whole, chunked):
        backend = chain.backends[0]
        kv = await backend.new_session_kv(range(0, 3), 32)
        outputs.append(await backend.serve_step(kv, prompt, 0))
        assert kv.length == 23
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=0)
    long_prompt = prompts()[1] * 2
    assert await chunked.greedy(long_prompt, 6) == await whole.greedy(long_prompt, 6)


async def test_a_failing_batch_fails_its_steps_and_the_batcher_keeps_serving(chain_factory: ChainFactory) -> None:
    chain = chain_factory(BatchPolicy())
    backend = chain.backends[0]
    kv = await backend.new_session_kv(range(0, 3), 8)
    with pytest.raises(RuntimeError):  # a hidden size the span's weights cannot multiply
        await backend.serve_step(kv, torch.randn(1, 1, 65), 0)
    assert await chain.greedy(prompts()[0], 3) == await chain.greedy(prompts()[0], 3)


def test_the_forecast_expects_sessions_by_their_rhythm() -> None:
    forecast: ArrivalForecast[SessionKV] = ArrivalForecast()
    steady, slow, new, gone = (SessionKV(0, 1, 1, 2, 4, torch.float32, torch.device("cpu")) for _ in range(4))
    for t in (0.0, 0.1, 0.2):  # steps every 100 ms
        forecast.arrived(steady, t)
    for t in (0.0, 0.4):  # every 400 ms
        forecast.arrived(slow, t)
    forecast.arrived(new, 0.25)  # one step: no rhythm yet, nobody waits for it
    for t in (-5.0, -4.9):  # stopped decoding long ago
        forecast.arrived(gone, t)
    assert forecast.due(now=0.25, until=0.27, present=()) == 0
    assert forecast.due(now=0.28, until=0.31, present=()) == 1  # steady is due at 0.3
    assert forecast.due(now=0.28, until=0.31, present={steady}) == 0  # ... unless already in the batch
    assert forecast.due(now=0.28, until=0.81, present=()) == 2  # slow is due at 0.8
    assert forecast.due(now=0.45, until=0.5, present=()) == 0  # steady is overdue by more than its interval: stalled
    assert forecast.running(now=0.45) == 3  # ... yet still counted as running (new, steady, slow) for a while
    del gone  # a closed session's KV is dropped, and with it its rhythm
    assert forecast.due(now=0.28, until=100.0, present=()) == 2
    forecast.forget(slow)
    assert forecast.due(now=0.28, until=100.0, present=()) == 1


class RecordingLinks(PushLinks):
    """Push links that record what a node would send on (the seam; the real streams run in test_push.py)."""

    def __init__(self) -> None:
        super().__init__(cast(P2P, None))
        self.sends: list[tuple[str, list[BatchRow], torch.Tensor]] = []

    def send(self, peer_id: str, rows: list[BatchRow], hidden: torch.Tensor) -> None:
        self.sends.append((peer_id, rows, hidden))


async def test_a_push_of_several_sessions_runs_as_one_forward_and_goes_on_as_one_push(
    chain_factory: ChainFactory,
) -> None:
    """A pushed batch reaches the next node's decode batcher together: one forward for all its sessions, whose
    outputs equal each session's step alone, and one push onward per next node."""
    chain = chain_factory(BatchPolicy())
    backend = chain.backends[0]
    hidden_size = chain.head.embed_tokens.embedding_dim
    generator = torch.Generator().manual_seed(11)
    contexts = [torch.randn(1, length, hidden_size, generator=generator) for length in PROMPT_LENGTHS]
    steps = torch.randn(len(PROMPT_LENGTHS), 1, hidden_size, generator=generator)
    pool = CachePool(4096)

    async def prefilled() -> list[Session]:
        sessions = []
        for context in contexts:
            kv = await backend.new_session_kv(range(0, 3), 32)
            await backend.serve_step(kv, context, 0)
            sessions.append(Session(kv, await pool.allocate(32), 0.0))
        return sessions

    alone = [await backend.serve_step(s.kv, steps[b : b + 1], s.kv.length) for b, s in enumerate(await prefilled())]

    async def step(session: Session, row: torch.Tensor, position: int) -> torch.Tensor:
        return await backend.serve_step(session.kv, row, position)

    sessions = await prefilled()
    onward = [NextHop(peer_id="node-c", session_id=f"c{b}") for b in range(len(sessions))]
    rows = [BatchRow(session_id=s.session_id, position=s.kv.length, next=[onward[b]]) for b, s in enumerate(sessions)]
    links = RecordingLinks()
    backend.batcher.batch_sizes.clear()
    outcome = await run_rows(rows, steps, list(sessions), step, links, pushed=True)
    assert list(backend.batcher.batch_sizes) == [len(PROMPT_LENGTHS)]
    assert outcome.errors == [None] * len(PROMPT_LENGTHS)
    torch.testing.assert_close(outcome.outputs, torch.cat(alone), atol=1e-5, rtol=0)
    ((peer, sent_rows, sent),) = links.sends
    assert peer == "node-c" and [r.session_id for r in sent_rows] == [hop.session_id for hop in onward]
    assert torch.equal(sent, outcome.outputs)
