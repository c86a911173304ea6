"""LoRA adapters through real processes: nodes serve them per span, the gateway lists and routes them.

One swarm: a DHT, two nodes of the tiny Llama (blocks 0:3 and 3:6) serving adapters ``one`` and ``two`` (made by
PEFT, with embedding and LM-head parts the gateway applies), the first node also ``half`` (so no node serves it for
blocks 3:6), and a gateway given all three that spot-checks every step. Requests for ``one``, the base model and
``two`` run at once; each stream's greedy tokens equal PEFT's (or transformers') ``generate`` alone, and the checks
(re-run with the session's adapter) find both nodes honest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import PreTrainedModel

from tests.helpers.adapters import ADAPTER_ONE, ADAPTER_TWO, TinyAdapter, make_adapter
from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm
from tests.tiny_models import GetTinyModel, TinyModel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NEW_TOKENS = 8
PROMPTS = {"one": [5, 17, 99, 3], None: [42, 8, 1, 77, 6], "two": [11, 12, 13]}


@pytest.fixture(scope="module")
def tiny(tiny_with_tokenizer: GetTinyModel) -> TinyModel:
    return tiny_with_tokenizer("llama")


@pytest.fixture(scope="module")
def adapters(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyAdapter]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        "one": make_adapter(tiny.model, folder / "one", 1, **ADAPTER_ONE),
        "two": make_adapter(tiny.model, folder / "two", 2, **ADAPTER_TWO),
        "half": make_adapter(tiny.model, folder / "half", 3, r=2, target_modules=["q_proj"]),
    }


def _flags(adapters: dict[str, TinyAdapter], names: tuple[str, ...]) -> list[str]:
    return ["--adapters", *(f"{name}={adapters[name].folder}" for name in names)]


@pytest.fixture(scope="module")
def gateway(module_swarm: LocalSwarm, tiny: TinyModel, adapters: dict[str, TinyAdapter]) -> Iterator[Gateway]:
    try:
        module_swarm.start_dht()
        first = module_swarm.start_node(tiny.folder, "0:3", *_flags(adapters, ("one", "two", "half")))
        second = module_swarm.start_node(tiny.folder, "3:6", *_flags(adapters, ("one", "two")))
        for node in (first, second):
            module_swarm.wait_serving(node)
        # Every step spot-checked: a check must re-run a step with the session's adapter (each node is the sole
        # replica of its blocks, so each check is a self-check), or honest nodes are outvoted by the base model.
        flags = (*_flags(adapters, ("one", "two", "half")), "--verify-check-rate", "1000")
        yield start_gateway(module_swarm, tiny.folder, *flags)
    finally:
        stop_gracefully(module_swarm)


def greedy_ids(model: PreTrainedModel, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
    return [int(t) for t in out[0, len(prompt) :]]


def tokens_of(choice: openai.types.CompletionChoice) -> list[int]:
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    return [int(token.removeprefix("t")) for token in choice.logprobs.tokens]


async def test_models_lists_each_adapter_every_block_of_which_is_served(gateway: Gateway) -> None:
    async with gateway.async_openai() as client:
        models = {model.id: model for model in (await client.models.list()).data}
        assert set(models) == {gateway.model, "one", "two"}  # "half": no node serves it for blocks 3:6
        assert models["one"].model_extra is not None and models["one"].model_extra["parent"] == gateway.model
        assert (await client.models.retrieve("two")).id == "two"
        for missing in ("half", "nope"):
            with pytest.raises(openai.NotFoundError) as error:
                await client.completions.create(model=missing, prompt=[1, 2, 3], max_tokens=2)
            assert error.value.code == "model_not_found"
    with gateway.http() as http:
        nodes = http.get("/v1/swarm").json()["nodes"]
    assert sorted((node["start"], tuple(node["adapters"])) for node in nodes) == [
        (0, ("half", "one", "two")),
        (3, ("one", "two")),
    ]


async def test_adapters_and_the_base_model_at_once_each_equal_peft_alone(
    gateway: Gateway, tiny: TinyModel, adapters: dict[str, TinyAdapter]
) -> None:
    async with gateway.async_openai() as client:

        async def complete(name: str | None) -> list[int]:
            response = await client.completions.create(
                model=name or gateway.model,
                prompt=PROMPTS[name],
                max_tokens=NEW_TOKENS,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )
            assert response.model == (name or gateway.model)  # answered as the model asked for
            return tokens_of(response.choices[0])

        for _ in range(2):  # streams of the three models interleave on both nodes
            results = await asyncio.gather(*(complete(name) for name in PROMPTS))
            for name, got in zip(PROMPTS, results, strict=True):
                reference = tiny.model if name is None else adapters[name].model
                assert got == greedy_ids(reference, PROMPTS[name], NEW_TOKENS), name
    assert greedy_ids(adapters["one"].model, PROMPTS["one"], NEW_TOKENS) != greedy_ids(
        tiny.model, PROMPTS["one"], NEW_TOKENS
    )  # the adapter changes the answer: the comparison could fail
    with gateway.http() as http:
        swarm = http.get("/v1/swarm").json()
    checks = {(c["kind"], c["result"]): c["count"] for c in swarm["checks"]}
    assert checks.get(("self", "agreed"), 0) > 0 and ("self", "outvoted") not in checks, checks
    assert all(node["verification"]["routed"] for node in swarm["nodes"]), swarm["nodes"]


def test_adapter_flags_name_folders(tmp_path: Path) -> None:
    from shared.lora import parse_adapter_specs

    assert parse_adapter_specs([f"a={tmp_path}"]) == {"a": tmp_path}
    with pytest.raises(ValueError, match="twice"):
        parse_adapter_specs([f"a={tmp_path}", f"a={tmp_path}"])
