"""Verification on a real swarm (a DHT, node processes and a gateway on 127.0.0.1, the openai client and httpx).

Probation: two honest nodes and a liar over the same blocks; the liar answers its challenge wrong, so it never
carries a user's step: every completion has the reference tokens, and /v1/swarm says why the liar is out while the
honest nodes are routed and spot-checked. Mid-stream: a liar routed as the first node of its blocks is outvoted when
honest nodes join, and the stream it carried goes on through them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.polling import wait_until
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.helpers.sse import completion_choices
from tests.tiny_models import GetTinyModel, TinyModel

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 3, 42, 8, 1]


@pytest.fixture(scope="module")
def tiny(tiny_with_tokenizer: GetTinyModel) -> TinyModel:
    return tiny_with_tokenizer("llama")


@pytest.fixture(scope="module")
def swarm(module_swarm: LocalSwarm, tiny: TinyModel) -> Iterator[tuple[Gateway, list[ManagedProcess], ManagedProcess]]:
    try:
        module_swarm.start_dht()
        honest = [module_swarm.start_node(tiny.folder, "0:6", name=f"honest-{i}") for i in range(2)]
        liar = module_swarm.start_node(tiny.folder, "0:6", "--faulty-outputs", "nan", name="liar")
        for node in (*honest, liar):
            module_swarm.wait_serving(node)
        # Every step checked: the test must see spot checks run, not wait for a 2 % chance.
        yield start_gateway(module_swarm, tiny.folder, "--verify-check-rate", "1000"), honest, liar
    finally:
        stop_gracefully(module_swarm)


def _nodes(gateway: Gateway) -> dict[str, dict[str, Any]]:
    with gateway.http() as http:
        return {node["peer_id"]: node for node in http.get("/v1/swarm").json()["nodes"]}


def test_a_liar_is_kept_out_by_its_challenge_and_honest_nodes_serve(
    swarm: tuple[Gateway, list[ManagedProcess], ManagedProcess], tiny: TinyModel
) -> None:
    gateway, honest, liar = swarm
    with torch.no_grad():
        out = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)
    expected = [int(t) for t in out[0, len(PROMPT) :]]
    tokenizer = AutoTokenizer.from_pretrained(tiny.folder)
    expected_text = str(tokenizer.decode(PROMPT + expected))[len(tokenizer.decode(PROMPT)) :]

    def settled() -> bool:
        states = {peer: node["verification"]["state"] for peer, node in _nodes(gateway).items()}
        return states.get(liar.peer_id) in ("failed", "distrusted") and all(
            states.get(node.peer_id) == "verified" for node in honest
        )

    wait_until(settled, within=60)
    client = gateway.openai()
    for _ in range(3):
        result = client.completions.create(
            model=gateway.model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert result.choices[0].text == expected_text
    nodes = _nodes(gateway)
    liar_state = nodes[liar.peer_id]["verification"]
    assert not liar_state["routed"] and "garbage" in liar_state["reason"], liar_state
    assert not nodes[liar.peer_id]["banned"]  # never routed, so never had a user step to fail
    for node in honest:
        assert nodes[node.peer_id]["verification"]["routed"]
    with gateway.http() as http:
        checks = {(c["kind"], c["result"]): c["count"] for c in http.get("/v1/swarm").json()["checks"]}
        metrics = http.get("/metrics").text
    assert checks.get(("spot", "agreed"), 0) > 0 and ("spot", "disputed") not in checks, checks
    # The liar is caught at its own challenge (failed) or, seen first, at a newcomer's (outvoted: both honest nodes'
    # challenges may run against it at once, each decided by the other, so it may be outvoted twice).
    caught = r'swarmgate_verification_checks_total\{kind="challenge",result="(failed|outvoted)"\} [12]\.0'
    assert re.search(caught, metrics), metrics


@pytest.mark.timeout(600)  # the liar's 2 s a message keeps the stream going while two nodes start under load
def test_a_liar_caught_mid_stream_hands_the_stream_to_verified_nodes(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    """The liar (``lazy``: it returns its input) is the first node of its blocks, so it is routed as unverified and
    a stream starts through it. Two honest nodes join mid-stream: the first one's challenge disagrees with the
    liar, the second breaks the tie, the liar is outvoted, and at its next step the stream moves to a verified node
    (its inputs replayed). From there on, every token is the honest model's greedy pick given the stream so far."""
    tiny = tiny_with_tokenizer("llama")
    try:
        local_swarm.start_dht()
        liar = local_swarm.start_node(
            tiny.folder, "0:6", "--faulty-outputs", "lazy", "--added-latency", "2.0", name="liar"
        )
        local_swarm.wait_serving(liar)
        gateway = start_gateway(local_swarm, tiny.folder, "--failover-wait", "300")
        wait_until(lambda: _nodes(gateway)[liar.peer_id]["verification"]["state"] == "unverified", within=60)
        body = {"model": gateway.model, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
        # Token strings from logprobs, not the text: the text leaves out special tokens (t0 is the tokenizer's unk),
        # which the liar's garbage may pick, and then the positions would not line up.
        body["logprobs"] = 0
        tokens: list[str] = []
        finish, honest = None, []
        with gateway.http() as http, http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as r:
            for choice in completion_choices(r):
                tokens += choice["logprobs"]["tokens"] if choice["logprobs"] else []
                finish = choice["finish_reason"] or finish
                if not honest:  # the stream runs through the liar: now the honest nodes come
                    honest = [local_swarm.start_node(tiny.folder, "0:6", name=f"honest-{i}") for i in range(2)]
        for node in honest:
            local_swarm.wait_serving(node)
        assert finish == "length"
        ids = [int(token.strip().removeprefix("t")) for token in tokens]
        assert len(ids) == 200
        with torch.no_grad():
            logits = tiny.model(torch.tensor([PROMPT + ids])).logits[0]
        picks = [int(p) for p in logits[len(PROMPT) - 1 : -1].argmax(dim=-1)]
        wrong = [i for i, (got, want) in enumerate(zip(ids, picks, strict=True)) if got != want]
        assert wrong, "the liar served no token: the test did not test a catch"
        assert wrong[-1] < len(ids) - 20, f"tokens still wrong at {wrong[-5:]}: the stream never left the liar"
        nodes = _nodes(gateway)
        assert nodes[liar.peer_id]["verification"]["state"] == "distrusted", nodes[liar.peer_id]
        # The tie-breaker's own challenge may still be waiting for a slot when the stream ends (a loaded machine).
        wait_until(
            lambda: all(_nodes(gateway)[n.peer_id]["verification"]["state"] == "verified" for n in honest),
            60,
            state=lambda: {n.name: _nodes(gateway)[n.peer_id]["verification"] for n in honest},
        )
        assert swarm_counters(gateway)["failovers"] >= 1
    finally:
        stop_gracefully(local_swarm)


def test_a_liar_answering_a_newcomers_challenge_with_garbage_loses_trust_and_the_newcomer_serves(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    """The liar (``forward-shape``: its sessions are right, its stateless forwards malformed) is the first node of
    its blocks, so it is every newcomer's reference. An honest node joins: its challenge gets the liar's garbage as
    the reference's answer. That is evidence against the liar, not the newcomer (a newcomer was failed for it, for
    good): the liar leaves routing, and the honest node, with no reference left, is routed as unverified."""
    tiny = tiny_with_tokenizer("llama")
    try:
        local_swarm.start_dht()
        liar = local_swarm.start_node(tiny.folder, "0:6", "--faulty-outputs", "forward-shape", name="liar")
        local_swarm.wait_serving(liar)
        gateway = start_gateway(local_swarm, tiny.folder)
        wait_until(lambda: _nodes(gateway)[liar.peer_id]["verification"]["state"] == "unverified", within=60)
        honest = local_swarm.start_node(tiny.folder, "0:6", name="honest")
        local_swarm.wait_serving(honest)

        def settled() -> bool:
            nodes = _nodes(gateway)
            return honest.peer_id in nodes and nodes[honest.peer_id]["verification"]["routed"]

        wait_until(settled, 60, state=lambda: {p: n["verification"] for p, n in _nodes(gateway).items()})
        nodes = _nodes(gateway)
        assert nodes[honest.peer_id]["verification"]["state"] in ("unverified", "verified"), nodes[honest.peer_id]
        liar_state = nodes[liar.peer_id]["verification"]
        assert liar_state["state"] == "distrusted" and "garbage" in liar_state["reason"], liar_state
        with torch.no_grad():
            out = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False)
        tokenizer = AutoTokenizer.from_pretrained(tiny.folder)
        expected = str(tokenizer.decode(PROMPT + [int(t) for t in out[0, len(PROMPT) :]]))
        result = gateway.openai().completions.create(
            model=gateway.model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert result.choices[0].text == expected[len(tokenizer.decode(PROMPT)) :]
    finally:
        stop_gracefully(local_swarm)


def test_a_liar_joining_next_to_an_honest_first_node_cannot_take_it_out_of_routing(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    """An honest node is the first of its blocks (unverified). A liar joins (``forward-shape``: its sessions are
    right, its stateless forwards malformed): its challenge passes, and the challenge back — the first node's
    session checked against the newcomer's forward — gets garbage. That is evidence against the newcomer: before,
    it outvoted the honest first node, and the only honest node of its blocks left routing."""
    tiny = tiny_with_tokenizer("llama")
    try:
        local_swarm.start_dht()
        first = local_swarm.start_node(tiny.folder, "0:6", name="first")
        local_swarm.wait_serving(first)
        gateway = start_gateway(local_swarm, tiny.folder)
        wait_until(lambda: _nodes(gateway)[first.peer_id]["verification"]["state"] == "unverified", within=60)
        liar = local_swarm.start_node(tiny.folder, "0:6", "--faulty-outputs", "forward-shape", name="liar")
        local_swarm.wait_serving(liar)

        def decided() -> bool:
            nodes = _nodes(gateway)
            return liar.peer_id in nodes and nodes[liar.peer_id]["verification"]["state"] not in (
                "probation",
                "verified",
            )

        wait_until(decided, 60, state=lambda: {p: n["verification"] for p, n in _nodes(gateway).items()})
        nodes = _nodes(gateway)
        assert nodes[liar.peer_id]["verification"]["state"] == "distrusted", nodes[liar.peer_id]
        assert "garbage" in nodes[liar.peer_id]["verification"]["reason"]
        assert nodes[first.peer_id]["verification"]["state"] == "unverified", nodes[first.peer_id]
        assert nodes[first.peer_id]["verification"]["routed"]
    finally:
        stop_gracefully(local_swarm)


@pytest.mark.parametrize("liar_first", [True, False], ids=["liar-first", "liar-joins"])
def test_a_node_whose_forwards_disagree_with_its_own_sessions_loses_trust_not_the_honest_node(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel, liar_first: bool
) -> None:
    """The liar (``forward-noise``) serves sessions right and answers stateless forwards — what a check asks of a
    reference, and of a newcomer to check an unverified first node's session — with plausible wrong values. A
    disagreement is held against a node only once its own forward and session agree: the liar's do not.
    First of its blocks, it is the honest newcomer's reference (before: the newcomer waited in probation for a third
    node that never came); joining, its forward checks the honest first node's session (before: the honest node was
    outvoted and left routing, the liar verified)."""
    tiny = tiny_with_tokenizer("llama")
    try:
        local_swarm.start_dht()
        liar_flags = ("--faulty-outputs", "forward-noise")
        first = local_swarm.start_node(tiny.folder, "0:6", *(liar_flags if liar_first else ()), name="first")
        local_swarm.wait_serving(first)
        gateway = start_gateway(local_swarm, tiny.folder)
        wait_until(lambda: _nodes(gateway)[first.peer_id]["verification"]["state"] == "unverified", within=60)
        second = local_swarm.start_node(tiny.folder, "0:6", *(() if liar_first else liar_flags), name="second")
        local_swarm.wait_serving(second)
        liar, honest = (first, second) if liar_first else (second, first)

        def decided() -> bool:
            nodes = _nodes(gateway)
            return liar.peer_id in nodes and nodes[liar.peer_id]["verification"]["state"] == "distrusted"

        wait_until(decided, 60, state=lambda: {p: n["verification"] for p, n in _nodes(gateway).items()})
        wait_until(lambda: _nodes(gateway)[honest.peer_id]["verification"]["routed"], 30, state=lambda: _nodes(gateway))
        assert "its own session" in _nodes(gateway)[liar.peer_id]["verification"]["reason"]
        assert _nodes(gateway)[honest.peer_id]["verification"]["state"] in ("unverified", "verified")
    finally:
        stop_gracefully(local_swarm)


def test_a_sole_replica_answering_its_spot_checks_forward_with_garbage_loses_trust(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    """The only node of its blocks is checked against itself: each served step re-run as a stateless forward. This
    one answers that forward with garbage (``forward-shape``); before, the check ended unjudged, so a sole replica
    that lied in its sessions could dodge every self-check that way. Now the garbage is held against it."""
    tiny = tiny_with_tokenizer("llama")
    try:
        local_swarm.start_dht()
        liar = local_swarm.start_node(tiny.folder, "0:6", "--faulty-outputs", "forward-shape", name="liar")
        local_swarm.wait_serving(liar)
        gateway = start_gateway(local_swarm, tiny.folder, "--verify-check-rate", "1000")  # every step checked
        wait_until(lambda: _nodes(gateway)[liar.peer_id]["verification"]["state"] == "unverified", within=60)
        # One token: the prefill step alone, so the stream has ended before its check (in the background) can
        # take the node out of routing under it.
        gateway.openai().completions.create(model=gateway.model, prompt=PROMPT, max_tokens=1, temperature=0)

        def caught() -> bool:
            return "spot check's forward with garbage" in _nodes(gateway)[liar.peer_id]["verification"]["reason"]

        wait_until(caught, 60, state=lambda: _nodes(gateway)[liar.peer_id]["verification"])
        assert _nodes(gateway)[liar.peer_id]["verification"]["state"] == "distrusted"
    finally:
        stop_gracefully(local_swarm)


def swarm_counters(gateway: Gateway) -> dict[str, int]:
    with gateway.http() as http:
        counters: dict[str, int] = http.get("/v1/swarm").json()["counters"]
        return counters
