"""The node's batch handler and the gateway's ``StepLinks``: concurrent sessions' decode steps as one message per node.

A real `swarm_node serve` process driven over hivemind P2P, as the gateway drives it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.p2p import P2P

from gateway.swarm import step_links
from gateway.swarm.chain_session import NodeSession
from gateway.swarm.routing import Hop
from gateway.swarm.step_links import StepLinks
from shared.errors import BadRequest, PositionOutOfRange, UnknownSession
from shared.wire import (
    BATCH_HANDLER,
    BatchRow,
    BatchStep,
    BatchStepResult,
    ErrorReply,
    encode_request,
)
from tests.helpers.polling import eventually
from tests.helpers.processes import LocalSwarm
from tests.helpers.raw_stream import RawStream
from tests.integration.conftest import client_dht
from tests.tiny_models import NUM_LAYERS, GetTinyModel

pytestmark = pytest.mark.timeout(300)

HIDDEN = 64


@pytest.fixture
async def links(client_p2p: P2P) -> AsyncIterator[StepLinks]:
    links = StepLinks(client_p2p, step_timeout=60)
    try:
        yield links
    finally:
        await links.close()


async def opened(p2p: P2P, peer: str, prompt: torch.Tensor, links: StepLinks | None) -> NodeSession:
    session = NodeSession(p2p, Hop(peer, 0, NUM_LAYERS), max_length=16, step_timeout=60, links=links)
    await session.open()
    await session.step(prompt, 0)
    return session


async def test_concurrent_decode_steps_travel_as_one_message_and_equal_each_session_alone(
    client_p2p: P2P, node_peer: str, links: StepLinks
) -> None:
    torch.manual_seed(0)
    prompts = [torch.randn(1, length, HIDDEN) for length in (5, 3, 7)]
    steps = [[torch.randn(1, 1, HIDDEN) for _ in range(4)] for _ in prompts]

    alone = []
    for prompt, own_steps in zip(prompts, steps, strict=True):
        session = await opened(client_p2p, node_peer, prompt, links=None)  # every step on its own stream
        alone.append([await session.step(hidden, prompt.shape[1] + n) for n, hidden in enumerate(own_steps)])
        await session.close()

    sessions = [await opened(client_p2p, node_peer, prompt, links) for prompt in prompts]
    together: list[list[torch.Tensor]] = [[] for _ in prompts]
    for n in range(4):
        sent = links.messages
        outputs = await asyncio.gather(
            *(s.step(steps[i][n], prompts[i].shape[1] + n) for i, s in enumerate(sessions))  # different positions
        )
        assert links.messages == sent + 1  # three sessions' steps, one message
        for i, output in enumerate(outputs):
            together[i].append(output)
    for session in sessions:
        await session.close()
    for got, want in zip(together, alone, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


async def test_verify_steps_travel_with_decode_steps_in_one_message_and_equal_each_session_alone(
    client_p2p: P2P, node_peer: str, links: StepLinks
) -> None:
    """Steps of several positions (a speculative verify step; one rewinds over rejected drafts) beside decode steps
    of one: one message, one forward, each row's output what its session gets alone on its own stream."""
    torch.manual_seed(1)
    prompts = [torch.randn(1, length, HIDDEN) for length in (5, 3, 7)]
    steps = [torch.randn(1, tokens, HIDDEN) for tokens in (1, 4, 3)]
    starts = [5, 3, 5]  # the third rewinds two of its prompt's tokens

    alone = []
    for prompt, hidden, start in zip(prompts, steps, starts, strict=True):
        session = await opened(client_p2p, node_peer, prompt, links=None)
        alone.append(await session.step(hidden, start))
        await session.close()
    sessions = [await opened(client_p2p, node_peer, prompt, links) for prompt in prompts]
    sent, rows = links.messages, links.rows
    together = await asyncio.gather(*(s.step(h, p) for s, h, p in zip(sessions, steps, starts, strict=True)))
    assert (links.messages, links.rows) == (sent + 1, rows + 3)
    for got, want in zip(together, alone, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for session in sessions:
        await session.close()


async def test_a_failing_row_fails_alone_and_the_others_are_answered(
    client_p2p: P2P, node_peer: str, links: StepLinks
) -> None:
    sessions = [await opened(client_p2p, node_peer, torch.randn(1, 4, HIDDEN), links) for _ in range(3)]
    positions = [4, 9, 4]  # the second leaves a gap after its 4 tokens
    sent = links.messages
    results = await asyncio.gather(
        *(s.step(torch.randn(1, 1, HIDDEN), p) for s, p in zip(sessions, positions, strict=True)),
        return_exceptions=True,
    )
    assert links.messages == sent + 1
    assert isinstance(results[1], PositionOutOfRange), results[1]
    for result in (results[0], results[2]):
        assert isinstance(result, torch.Tensor) and result.shape == (1, 1, HIDDEN)
    # The failed row's session is intact: its next step, at the right position, works.
    assert (await sessions[1].step(torch.randn(1, 1, HIDDEN), 4)).shape == (1, 1, HIDDEN)
    for session in sessions:
        await session.close()


async def test_more_rows_than_one_message_may_carry_go_in_several(
    client_p2p: P2P, node_peer: str, links: StepLinks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_links, "MAX_BATCH_ROWS", 2)
    sessions = [await opened(client_p2p, node_peer, torch.randn(1, 4, HIDDEN), links) for _ in range(5)]
    sent = links.messages
    outputs = await asyncio.gather(*(s.step(torch.randn(1, 1, HIDDEN), 4) for s in sessions))
    assert links.messages == sent + 3  # 2 + 2 + 1 rows
    assert all(output.shape == (1, 1, HIDDEN) and output.any() for output in outputs)
    for session in sessions:
        await session.close()


async def send_batch(
    stream: RawStream, rows: list[BatchRow], hidden: torch.Tensor
) -> tuple[object, list[torch.Tensor]]:
    return await stream.send(encode_request(BatchStep(rows=rows), (hidden,)))


async def test_only_the_client_that_opened_a_session_can_step_it_and_bad_batches_are_refused(
    client_p2p: P2P, node_peer: str, module_swarm: LocalSwarm
) -> None:
    session = await opened(client_p2p, node_peer, torch.randn(1, 4, HIDDEN), links=None)
    assert session._session_id is not None
    row = BatchRow(session_id=session._session_id, position=4)
    other_dht = client_dht(module_swarm.initial_peers)
    try:
        other = await other_dht.replicate_p2p()
        async with RawStream(other, node_peer, BATCH_HANDLER) as stranger:
            reply, (output,) = await send_batch(stranger, [row], torch.randn(1, 1, HIDDEN))
            assert isinstance(reply, BatchStepResult) and reply.errors[0] is not None
            assert isinstance(reply.errors[0].to_exception(), UnknownSession)
            assert not output.any()
    finally:
        other_dht.shutdown()

    async with RawStream(client_p2p, node_peer, BATCH_HANDLER) as owner:
        for rows, hidden in (
            ([row], torch.randn(2, 1, HIDDEN)),  # rows and hidden states disagree
            ([row], torch.randn(1, 2, HIDDEN)),  # a batch step carries one token per row
            ([row, row], torch.randn(2, 1, HIDDEN)),  # the same session twice
        ):
            reply, _ = await send_batch(owner, rows, hidden)
            assert isinstance(reply, ErrorReply) and isinstance(reply.to_exception(), BadRequest), reply
        # The stranger's attempt and the refusals left the session as it was: its opener steps it at position 4.
        reply, (output,) = await send_batch(owner, [row], torch.randn(1, 1, HIDDEN))
        assert isinstance(reply, BatchStepResult) and reply.errors == [None], reply
        assert output.shape == (1, 1, HIDDEN) and output.any()
    await session.close()


async def test_a_node_that_dies_fails_every_row_it_carried_and_the_links_serve_on(
    local_swarm: LocalSwarm, tiny_model: GetTinyModel
) -> None:
    local_swarm.start_dht()
    folder = tiny_model("llama").folder
    node = local_swarm.start_node(folder, f"0:{NUM_LAYERS}", "--added-latency", "1.0")
    peer = local_swarm.wait_serving(node)
    dht = client_dht(local_swarm.initial_peers)
    p2p = await dht.replicate_p2p()
    links = StepLinks(p2p, step_timeout=3)  # hivemind ends a stream to a dead peer only at the next send
    try:
        sessions = [await opened(p2p, peer, torch.randn(1, 4, HIDDEN), links) for _ in range(2)]
        steps = asyncio.gather(*(s.step(torch.randn(1, 1, HIDDEN), 4) for s in sessions), return_exceptions=True)
        sent = links.messages
        await eventually(lambda: links.messages > sent, within=10)  # on its way (the node waits 1 s to answer)
        node.send(signal.SIGKILL)  # with its p2p daemon
        results = await asyncio.wait_for(steps, 20)
        assert all(type(r).__name__ in ("NodeUnreachable", "StepTimeout") for r in results), results
        # A new node, a new link stream: the same links object serves it.
        fresh = local_swarm.start_node(folder, f"0:{NUM_LAYERS}")
        fresh_peer = local_swarm.wait_serving(fresh)
        session = await opened(p2p, fresh_peer, torch.randn(1, 4, HIDDEN), links)
        assert (await session.step(torch.randn(1, 1, HIDDEN), 4)).shape == (1, 1, HIDDEN)
        await session.close()
    finally:
        await links.close()
        dht.shutdown()
