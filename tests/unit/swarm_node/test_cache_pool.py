"""The node's memory accounting: the cache pool, sessions and their idle expiry, and the default pool size."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import LlamaConfig

from shared.errors import CacheFull, UnknownSession
from swarm_node.cache_pool import CachePool
from swarm_node.capacity import MIN_CACHE_TOKENS, block_weight_bytes, default_cache_tokens
from swarm_node.kv_cache import SessionKV
from swarm_node.sessions import SessionRegistry
from tests.tiny_models import TINY_CONFIGS


def tiny_kv(max_length: int = 4) -> SessionKV:
    return SessionKV(0, 1, 1, 2, max_length, torch.float32, torch.device("cpu"))


async def test_allocations_are_counted_exactly_and_released_once() -> None:
    pool = CachePool(100)
    first, second = await pool.allocate(60), await pool.allocate(40)
    assert (pool.tokens_left, pool.sessions) == (0, 2)
    first.release()
    first.release()  # idempotent: a second release must not give the room back twice
    assert (pool.tokens_left, pool.sessions) == (60, 1)
    second.release()
    assert (pool.tokens_left, pool.sessions) == (100, 0)


async def test_a_full_pool_refuses_with_a_typed_retryable_error() -> None:
    pool = CachePool(100)
    held = await pool.allocate(80)
    with pytest.raises(CacheFull) as refused:
        await pool.allocate(30)
    assert refused.value.retryable and refused.value.code == "cache_full"
    with pytest.raises(CacheFull, match="exceed this node's whole cache"):
        await pool.allocate(101, wait=10)  # can never fit: no point waiting
    held.release()
    assert pool.tokens_left == 100


async def test_a_waiting_request_gets_room_when_it_is_freed_or_fails_after_its_timeout() -> None:
    pool = CachePool(100)
    held = await pool.allocate(90)
    waiting = asyncio.create_task(pool.allocate(50, wait=30))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    held.release()
    granted = await asyncio.wait_for(waiting, 5)
    assert pool.tokens_left == 50
    with pytest.raises(CacheFull, match="after waiting"):
        await pool.allocate(60, wait=0.05)
    granted.release()
    assert (pool.tokens_left, pool.sessions) == (100, 0)


async def test_a_cancelled_wait_takes_nothing() -> None:
    pool = CachePool(10)
    held = await pool.allocate(10)
    waiting = asyncio.create_task(pool.allocate(5, wait=30))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    held.release()
    assert (pool.tokens_left, pool.sessions) == (10, 0)


async def test_fifty_concurrent_sessions_asking_for_more_than_the_pool_holds_leave_it_unchanged() -> None:
    pool = CachePool(1000)
    rng = random.Random(0)
    outcomes: list[str] = []

    async def session(index: int) -> None:
        wait = 0.0 if index % 2 else 0.3  # half refuse at once when full, half wait a little for room
        try:
            async with pool.reserve(rng.choice([100, 150, 250]), wait):
                assert pool.tokens_left >= 0
                await asyncio.sleep(rng.uniform(0.0, 0.02))
                if index % 7 == 0:
                    raise RuntimeError("a session that fails mid-way still gives its room back")
            outcomes.append("served")
        except CacheFull:
            outcomes.append("refused")
        except RuntimeError:
            outcomes.append("failed")

    await asyncio.gather(*(session(i) for i in range(50)))
    assert len(outcomes) == 50
    assert "refused" in outcomes and "served" in outcomes
    assert (pool.tokens_left, pool.sessions) == (1000, 0)


async def test_a_resized_allocation_is_counted_exactly_and_released_whole() -> None:
    pool = CachePool(100)
    held, other = await pool.allocate(30), await pool.allocate(20)
    await pool.resize(held, 70)  # grows by 40: granted like a new allocation of the difference
    assert (pool.tokens_left, pool.sessions, held.tokens) == (10, 2, 70)
    with pytest.raises(CacheFull, match="11 tokens asked, 10 free"):
        await pool.resize(held, 81)
    with pytest.raises(CacheFull, match="exceed this node's whole cache"):
        await pool.resize(held, 101, wait=10)
    assert (pool.tokens_left, held.tokens) == (10, 70)  # a refusal changes nothing
    await pool.resize(held, 5)  # shrinking gives the difference back at once
    assert (pool.tokens_left, pool.sessions) == (75, 2)
    held.release()
    held.release()
    other.release()
    assert (pool.tokens_left, pool.sessions) == (100, 0)
    with pytest.raises(ValueError, match="live allocation"):
        await pool.resize(held, 10)


async def test_a_growing_allocation_waits_for_room_a_shrink_frees() -> None:
    pool = CachePool(100)
    first, second = await pool.allocate(50), await pool.allocate(50)
    growing = asyncio.create_task(pool.resize(first, 80, wait=30))
    await asyncio.sleep(0.01)
    assert not growing.done()
    await pool.resize(second, 20)  # a shrink wakes the waiter like a release does
    await asyncio.wait_for(growing, 5)
    assert (pool.tokens_left, first.tokens) == (0, 80)
    waiting = asyncio.create_task(pool.resize(second, 30, wait=30))
    await asyncio.sleep(0.01)
    second.release()  # its session ended while it waited: nothing is granted
    with pytest.raises(ValueError, match="released while it waited"):
        await asyncio.wait_for(waiting, 5)
    first.release()
    assert (pool.tokens_left, pool.sessions) == (100, 0)


def test_a_resized_session_kv_keeps_its_stored_tokens() -> None:
    kv = tiny_kv(max_length=4)
    kv.keys.normal_()
    kv.values.normal_()
    kv.length = 3
    stored = kv.keys[:, :, :3].clone(), kv.values[:, :, :3].clone()
    kv.resize(10)
    assert kv.keys.shape[2] == kv.values.shape[2] == kv.max_length == 10
    assert torch.equal(kv.keys[:, :, :3], stored[0]) and torch.equal(kv.values[:, :, :3], stored[1])
    kv.resize(3)
    assert torch.equal(kv.keys, stored[0]) and kv.length == 3
    with pytest.raises(ValueError, match="below the 3 stored"):
        kv.resize(2)


async def test_wait_until_empty_returns_after_the_last_release() -> None:
    pool = CachePool(10)
    held = [await pool.allocate(2) for _ in range(3)]
    drained = asyncio.create_task(pool.wait_until_empty())
    for allocation in held:
        await asyncio.sleep(0.01)
        assert not drained.done()
        allocation.release()
    await asyncio.wait_for(drained, 5)


async def test_idle_sessions_expire_and_give_their_room_back() -> None:
    now = [0.0]
    pool = CachePool(100)
    sessions = SessionRegistry(idle_timeout=10.0, clock=lambda: now[0])
    idle = sessions.add(tiny_kv(), await pool.allocate(30))
    stepping = sessions.add(tiny_kv(), await pool.allocate(30))
    now[0] = 5.0
    with sessions.active(stepping):
        now[0] = 30.0
        assert sessions.expire_idle() == [idle]  # a session in the middle of a step is never idle
    assert (pool.tokens_left, len(sessions)) == (70, 1)
    with pytest.raises(UnknownSession, match="expired"), sessions.active(idle):
        pass
    now[0] = 39.0
    assert sessions.expire_idle() == []  # the step just ended: its idle time starts again
    sessions.close(stepping)
    sessions.close(stepping)
    sessions.close(idle)  # closing an expired session (its stream ends later) is harmless
    assert (pool.tokens_left, pool.sessions, len(sessions)) == (100, 0, 0)


def _llama() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8
    )


def test_default_pool_size_comes_from_the_memory_left_after_the_weights() -> None:
    config = _llama()
    per_token = 2 * 4 * 2 * 64 * 2  # K+V, 4 blocks, 2 kv heads, head_dim 64, bfloat16
    cuda = torch.device("cuda")
    weights = 4 * block_weight_bytes(config, torch.bfloat16, "none")
    free = weights + 1000 * per_token
    assert default_cache_tokens(config, 4, cuda, torch.bfloat16, "none", free_bytes=free) == 900
    # Quantized weights leave more of the same GPU for the cache.
    assert default_cache_tokens(config, 4, cuda, torch.bfloat16, "nf4", free_bytes=free) > 900
    with pytest.raises(ValueError, match="--cache-tokens"):
        default_cache_tokens(config, 4, cuda, torch.bfloat16, "none", free_bytes=weights)
    cpu = torch.device("cpu")
    assert default_cache_tokens(config, 4, cpu, torch.float32, "none", free_bytes=1 << 40) == 16384
    small = 4 * 2 * 4 * 2 * 64 * 4 * MIN_CACHE_TOKENS * 2  # a quarter of it holds 2x the minimum
    assert default_cache_tokens(config, 4, cpu, torch.float32, "none", free_bytes=small) == 2 * MIN_CACHE_TOKENS


def test_quantized_blocks_take_a_fraction_of_the_memory() -> None:
    config = _llama()
    plain = block_weight_bytes(config, torch.bfloat16, "none")
    int8, nf4 = (block_weight_bytes(config, torch.bfloat16, quant) for quant in ("int8", "nf4"))
    assert 0.45 * plain < int8 < 0.6 * plain
    assert 0.2 * plain < nf4 < 0.3 * plain


@pytest.mark.parametrize("variant", ["mixtral", "falcon_new", "bloom"])
def test_block_weights_of_other_families_count_experts_and_their_own_names(variant: str) -> None:
    """Mixtral's experts are most of its block and are quantized too; Falcon builds its layer by attention name."""
    config = TINY_CONFIGS[variant]()
    plain = block_weight_bytes(config, torch.bfloat16, "none")
    nf4 = block_weight_bytes(config, torch.bfloat16, "nf4")
    assert 0.2 * plain < nf4 < 0.35 * plain
