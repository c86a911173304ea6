"""Probation at join on a real swarm: two honest nodes and a liar over the same blocks (a DHT, three node processes
and a gateway on 127.0.0.1). The liar answers its challenge wrong, so it never carries a user's step: every
completion has the reference tokens, and /v1/swarm says why the liar is out while the honest nodes are routed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.polling import wait_until
from tests.helpers.processes import LocalSwarm, ManagedProcess
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
    assert 'swarmgate_verification_checks_total{kind="challenge",result="failed"}' in metrics
