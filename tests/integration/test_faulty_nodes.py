"""Broken nodes: one answers NaNs, one a wrong shape, one a wrong dtype, one right outputs under receipts its
certified step key did not sign (``--faulty-outputs``). They are the fastest route (a healthy replica has 50 ms
added), so the gateway tries them first; it must ban each (or never route it: its challenge fails) and finish every
request on the healthy node with exactly the reference tokens — no garbage, and no unsigned output, reaches the
client.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.tiny_models import GetTinyModel, TinyModel

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 17, 99, 3, 42, 8, 1]
FAULTS = ("nan", "shape", "dtype", "bad-receipt")


@pytest.fixture(scope="module")
def tiny(tiny_with_tokenizer: GetTinyModel) -> TinyModel:
    return tiny_with_tokenizer("llama")


@pytest.fixture(scope="module")
def swarm(module_swarm: LocalSwarm, tiny: TinyModel) -> Iterator[tuple[Gateway, list[ManagedProcess]]]:
    try:
        module_swarm.start_dht()
        healthy = module_swarm.start_node(tiny.folder, "0:6", "--added-latency", "0.05", name="healthy")
        faulty = [
            module_swarm.start_node(tiny.folder, "0:6", "--faulty-outputs", fault, name=f"faulty-{fault}")
            for fault in FAULTS
        ]
        for node in (healthy, *faulty):
            module_swarm.wait_serving(node)
        yield start_gateway(module_swarm, tiny.folder, "--step-timeout", "10"), faulty
    finally:
        stop_gracefully(module_swarm)


def test_nodes_returning_nan_wrong_shape_or_dtype_are_banned_and_routed_around(
    swarm: tuple[Gateway, list[ManagedProcess]], tiny: TinyModel
) -> None:
    gateway, faulty = swarm
    with torch.no_grad():
        out = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)
    expected = [int(t) for t in out[0, len(PROMPT) :]]
    tokenizer = AutoTokenizer.from_pretrained(tiny.folder)
    expected_text = str(tokenizer.decode(PROMPT + expected))[len(tokenizer.decode(PROMPT)) :]
    client = gateway.openai()
    for _ in range(2):  # the second request finds them banned already
        result = client.completions.create(
            model=gateway.model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert result.choices[0].text == expected_text
    with gateway.http() as http:
        nodes = {node["peer_id"]: node for node in http.get("/v1/swarm").json()["nodes"]}
    for node in faulty:  # banned by a user's step, or never routed: its challenge (gateway.swarm.verify) caught it
        state = nodes[node.peer_id]
        assert state["banned"] or not state["verification"]["routed"], (node.name, state)
