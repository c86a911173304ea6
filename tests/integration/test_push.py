"""Node-to-node push with real node processes: chains that push equal transformers, failover of any position of a
three-node chain keeps the tokens, strangers may not push, and a step that arrives twice runs once."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P

from gateway.model.head import ModelHead, build_head
from gateway.swarm import chain_session
from gateway.swarm import router as router_module
from gateway.swarm.chain_session import ChainSession
from gateway.swarm.failover import FailoverPolicy
from gateway.swarm.monitor import SwarmMonitor
from gateway.swarm.node_session import NodeSession
from gateway.swarm.push_step import push_step
from gateway.swarm.router import Router
from gateway.swarm.routing import Hop
from gateway.swarm.step_links import StepLinks
from shared.dht_records import fetch_servers
from shared.model_source import load_config, resolve_model
from shared.rpc_client import fetch_info
from shared.weights import open_weights
from shared.wire import PUSH_HANDLER, BatchRow, PushAccepted, PushStep, encode_request
from tests.helpers.chain_greedy import chain_greedy
from tests.helpers.processes import LocalSwarm
from tests.helpers.raw_stream import RawStream
from tests.integration.conftest import client_dht, client_peer
from tests.tiny_models import NUM_LAYERS, GetTinyModel

pytestmark = pytest.mark.timeout(600)

HIDDEN = 64
SPANS = ["0:2", "2:4", "4:6"]
PROMPT = [7, 1, 8, 2, 8]


@pytest.fixture
async def other_p2p(module_swarm: LocalSwarm) -> AsyncIterator[P2P]:
    """A second peer: the predecessor a session names, or a stranger."""
    async with client_peer(module_swarm.initial_peers) as p2p:
        yield p2p


async def tokens_processed(p2p: P2P, peer: str) -> int:
    info, _ = await fetch_info(p2p, peer, 30)
    return info.tokens_processed


async def push(p2p: P2P, peer: str, session_id: str, position: int, hidden: torch.Tensor) -> PushAccepted:
    async with RawStream(p2p, peer, PUSH_HANDLER) as stream:
        reply, _ = await stream.send(
            encode_request(PushStep(rows=[BatchRow(session_id=session_id, position=position)]), (hidden,))
        )
    assert isinstance(reply, PushAccepted)
    return reply


async def test_only_the_opener_or_the_named_predecessor_may_push_and_a_step_pushed_and_relayed_runs_once(
    client_p2p: P2P, other_p2p: P2P, node_peer: str, module_swarm: LocalSwarm
) -> None:
    stranger_dht = client_dht(module_swarm.initial_peers)
    stranger = await stranger_dht.replicate_p2p()
    links = StepLinks(client_p2p, step_timeout=60)
    session = NodeSession(client_p2p, Hop(node_peer, 0, NUM_LAYERS), 16, 60, links=links)
    session.pusher = other_p2p.peer_id.to_base58()
    try:
        torch.manual_seed(0)
        await session.open()
        await session.step(torch.randn(1, 4, HIDDEN), 0)
        session_id = session.next_hop.session_id if session.next_hop else ""
        step = torch.randn(1, 1, HIDDEN)

        before = await tokens_processed(client_p2p, node_peer)
        refused = await push(stranger, node_peer, session_id, 4, step)
        assert refused.errors[0] is not None and refused.errors[0].code == "push_refused"
        assert await tokens_processed(client_p2p, node_peer) == before  # nothing ran

        # The named predecessor pushes; the gateway's "answer me when pushed" gets that step's input and output, and
        # the same step relayed by the gateway afterwards is answered from that run, not run again.
        waiting = asyncio.ensure_future(session.pushed(4, step))
        accepted = await push(other_p2p, node_peer, session_id, 4, step)
        assert accepted.errors == [None]
        received, pushed_output = await waiting
        assert torch.equal(received, step)
        relayed_output = await session.step(step, 4)
        assert torch.equal(relayed_output, pushed_output)
        assert await tokens_processed(client_p2p, node_peer) == before + 1

        # A different input at the same position is a new step (a replacement predecessor's): it rewinds and runs.
        other = await session.step(torch.randn(1, 1, HIDDEN), 4)
        assert not torch.equal(other, pushed_output)
        assert await tokens_processed(client_p2p, node_peer) == before + 2
    finally:
        await session.close()
        await links.close()
        stranger_dht.shutdown()


class PushClient:
    """The gateway's parts for one model (head, view, router, links), with chains that push."""

    def __init__(self, folder: Path, swarm: LocalSwarm) -> None:
        source = resolve_model(str(folder))
        self.config = load_config(source)
        self.dht = client_dht(swarm.initial_peers)
        self.head: ModelHead = build_head(self.config, open_weights(source, self.config))
        self.model_name = source.name

    async def __aenter__(self) -> PushClient:
        self.p2p = await self.dht.replicate_p2p()
        monitor = SwarmMonitor(self.dht, self.model_name, self.config.num_hidden_layers, max_age=0.5)
        self.router = Router(monitor, self.p2p)
        self.links = StepLinks(self.p2p, 3.0, self.router.liveness)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.links.close()
        await self.router.close()
        self.dht.shutdown()

    def chain(self, push: bool = True, push_min_rtt: float = 0.0) -> ChainSession:
        return ChainSession(
            self.p2p,
            self.router,
            64,
            3.0,
            links=self.links,
            push=push,
            failover=FailoverPolicy(wait=30),
            push_min_rtt=push_min_rtt,
        )

    def greedy(self, chain: ChainSession, new_tokens: int) -> AsyncIterator[int]:
        return chain_greedy(self.head, chain, PROMPT, new_tokens)

    async def wait_nodes(self, count: int, limit: float = 60.0) -> None:
        deadline = time.monotonic() + limit
        while len(await fetch_servers(self.dht, self.model_name, self.config.num_hidden_layers)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {count} nodes announced within {limit}s")
            await asyncio.sleep(0.3)


def start_chain_nodes(swarm: LocalSwarm, folder: Path, spans: list[str]) -> None:
    swarm.start_dht()
    swarm.start_nodes(folder, spans)


async def test_a_three_node_chain_that_pushes_equals_generate(
    local_swarm: LocalSwarm, tiny_model: GetTinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = tiny_model("llama")
    start_chain_nodes(local_swarm, tiny.folder, SPANS)
    expected = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, 5:].tolist()
    async with PushClient(tiny.folder, local_swarm) as client:
        await client.wait_nodes(3)
        async with client.chain(push=False) as chain:
            relayed = [t async for t in client.greedy(chain, 12)]
        before = client.router.stats.pushed_hops, client.router.stats.relayed_hops
        async with client.chain() as chain:
            assert len(chain.hops) == 3
            pushed = [t async for t in client.greedy(chain, 12)]
            _one_valid_receipt_per_hop(chain)
        assert pushed == relayed == expected
        # 11 decode steps: the gateway sent each to the first node only; the two later hops came node to node.
        assert client.router.stats.pushed_hops - before[0] == 22
        assert client.router.stats.relayed_hops - before[1] == 11
        # Nodes nearer the gateway than push_min_rtt (loopback here) are relayed to: pushing would not pay.
        async with client.chain(push_min_rtt=10.0) as chain:
            assert [t async for t in client.greedy(chain, 12)] == expected
        assert client.router.stats.pushed_hops - before[0] == 22
        assert client.router.stats.relayed_hops - before[1] == 11 + 33
        await _verify_steps_and_rewinds_over_their_rejected_drafts_are_pushed(client, expected, monkeypatch)


def _one_valid_receipt_per_hop(chain: ChainSession) -> None:
    """The last pushed step left one receipt per hop, each signed by that hop's node for its blocks, verified by the
    gateway; each hop's signed input is the output the hop before it signed."""
    receipts = [segment.session.last_receipt for segment in chain.segments]
    assert all(receipt is not None for receipt in receipts)
    for hop, receipt in zip(chain.hops, receipts, strict=True):
        assert receipt is not None and receipt.signer == hop.peer_id
        assert (receipt.statement.start, receipt.statement.end) == (hop.start, hop.end)
    statements = [receipt.statement for receipt in receipts if receipt is not None]
    assert len({s.position for s in statements}) == 1
    for before, after in zip(statements, statements[1:], strict=False):
        assert after.input_digest == before.output_digest


async def _verify_steps_and_rewinds_over_their_rejected_drafts_are_pushed(
    client: PushClient, expected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculative verify step goes node to node like a decode step, and so does the next step, which rewinds the
    nodes over the drafts it rejected (the nodes' step slots hold the verify step: the push comes after it); after a
    truncate the nodes no longer know their latest step, and a rewind is relayed."""

    def embed(ids: list[int]) -> torch.Tensor:
        return client.head.embed(torch.tensor([ids]))

    def greedy(output: torch.Tensor, at: int = -1) -> int:
        return int(client.head.logits(output)[0, at].argmax())

    pushes: list[int] = []  # positions of the steps that went node to node (a refused push looks relayed in stats)

    async def counted(chain: ChainSession, hidden: torch.Tensor, position: int) -> torch.Tensor:
        pushes.append(position)
        return await push_step(chain, hidden, position)

    monkeypatch.setattr(chain_session, "push_step", counted)
    async with client.chain() as chain:
        await chain.step(embed(PROMPT), 0)
        stats = client.router.stats
        before = stats.pushed_hops
        wrong = [(expected[1] + 1) % 128, 7]
        verify = await chain.step(embed([expected[0], *wrong]), 5)  # the nodes hold 8 tokens; both drafts rejected
        assert greedy(verify, 0) == expected[1] and stats.pushed_hops - before == 2
        assert greedy(await chain.step(embed([expected[1]]), 6)) == expected[2]  # rewinds to 6, pushed
        assert greedy(await chain.step(embed([expected[2]]), 7)) == expected[3]
        assert stats.pushed_hops - before == 6  # two later hops of each of the three steps
        await chain.truncate(7)
        assert greedy(await chain.step(embed([expected[1]]), 6)) == expected[2]  # relayed
        assert stats.pushed_hops - before == 6
    assert pushes == [5, 6, 7]


DEFAULT_LOSSES = {("kill", 1), ("freeze", 2)}
SOAK = pytest.mark.soak

# Two of the six losses in `make test` (a node killed mid-chain, the last one frozen); `make test-soak` runs all six.
LOSSES = [
    pytest.param(position, how, id=f"{name}-{position}", marks=() if (name, position) in DEFAULT_LOSSES else SOAK)
    for name, how in (("kill", signal.SIGKILL), ("freeze", signal.SIGSTOP))
    for position in (0, 1, 2)
]


@pytest.mark.parametrize(("position", "how"), LOSSES)
async def test_losing_any_node_of_a_pushing_chain_keeps_the_tokens(
    local_swarm: LocalSwarm, tiny_model: GetTinyModel, position: int, how: signal.Signals
) -> None:
    tiny = tiny_model("llama")
    start_chain_nodes(local_swarm, tiny.folder, [*SPANS, SPANS[position]])  # a spare for the victim's blocks
    expected = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)[0, 5:].tolist()
    async with PushClient(tiny.folder, local_swarm) as client:
        await client.wait_nodes(4)
        async with client.chain() as chain:
            victim_peer = chain.hops[position].peer_id
            victim = next(p for p in local_swarm.processes if p.peer_id == victim_peer)
            tokens: list[int] = []
            pushed_at_loss = 0
            try:
                async for token in client.greedy(chain, 16):
                    tokens.append(token)
                    if len(tokens) == 5:
                        victim.send(how)
                        pushed_at_loss = client.router.stats.pushed_hops
            finally:
                if how == signal.SIGSTOP:
                    victim.send(signal.SIGCONT)
            assert chain.failovers >= 1 and victim_peer not in [hop.peer_id for hop in chain.hops]
            assert chain.push  # the chain pushes on through the replacement
        assert tokens == expected
        assert client.router.stats.pushed_hops >= pushed_at_loss + 2 * 8  # the steps after the loss pushed too


async def test_a_chain_with_two_hops_on_one_node_pushes_from_the_node_to_itself(
    local_swarm: LocalSwarm, tiny_model: GetTinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failover can patch a lost range with a hop on the node that serves the next one (... X[14:15), X[15:18)
    ...: seen in a 24-node churn run). libp2p refuses to dial itself; the node hands such a push to itself, so the
    second hop is pushed, not relayed by the gateway step after step, and the tokens are generate's."""
    tiny = tiny_model("llama")
    start_chain_nodes(local_swarm, tiny.folder, ["0:6"])
    expected = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, 5:].tolist()
    async with PushClient(tiny.folder, local_swarm) as client:
        await client.wait_nodes(1)
        (node,) = await fetch_servers(client.dht, client.model_name, client.config.num_hidden_layers)
        split = [Hop(node, 0, 3), Hop(node, 3, 6)]
        monkeypatch.setattr(router_module, "plan_route", lambda *_: split)
        before = client.router.stats.pushed_hops, client.router.stats.relayed_hops
        async with client.chain() as chain:
            assert chain.hops == split
            assert [t async for t in client.greedy(chain, 12)] == expected
        # 11 decode steps: each sent to the first hop by the gateway, the second hop's pushed by the node to itself.
        assert client.router.stats.pushed_hops - before[0] == 11
        assert client.router.stats.relayed_hops - before[1] == 11
