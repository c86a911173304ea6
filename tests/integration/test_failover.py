"""Failover as an operator meets it, with real processes on 127.0.0.1 and the openai client: the sole replica of a
span dies mid-stream while its replacement is still loading, and a burst of opens finds a node's cache pool full.

What must hold: the stream completes with exactly the reference tokens (the session waits for the replacement, then
replays exactly what the lost node had), the dead node's lingering record is not dialled again, and a full node is
waited on or routed around — never banned.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm
from tests.helpers.sse import completion_choices
from tests.tiny_models import GetTinyModel, TinyModel

pytestmark = pytest.mark.timeout(600)

PROMPT = [5, 17, 99, 3, 42, 8, 1]
DISTANCE = ("--added-latency", "0.05")  # every node reply takes 50 ms more: a generation lasts long enough to kill


def reference_text(tiny: TinyModel, new_tokens: int) -> str:
    with torch.no_grad():
        out = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny.folder)
    full = str(tokenizer.decode(PROMPT + [int(t) for t in out[0, len(PROMPT) :]]))
    return full[len(tokenizer.decode(PROMPT)) :]


def swarm_json(gateway: Gateway) -> dict[str, object]:
    with gateway.http() as http:
        body: dict[str, object] = http.get("/v1/swarm").json()
        return body


def wait_for_metric(gateway: Gateway, pattern: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    with gateway.http() as http:
        while time.monotonic() < deadline:
            if re.search(pattern, http.get("/metrics").text, re.MULTILINE):
                return
            time.sleep(0.2)
    raise AssertionError(f"/metrics never showed {pattern!r}:\n{gateway.log_text()[-3000:]}")


def test_the_sole_replica_killed_mid_stream_waits_for_its_replacement_and_keeps_the_tokens(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("llama")
    expected = reference_text(tiny, 40)
    try:
        local_swarm.start_dht()
        local_swarm.start_nodes(tiny.folder, ("0:3", "3:6"), *DISTANCE)
        victim = local_swarm.processes[-1]
        gateway = start_gateway(local_swarm, tiny.folder, "--failover-wait", "300")
        body = {"model": gateway.model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
        text, finish, events = "", None, 0
        # httpx, not the openai client: while the session waits the gateway sends SSE keep-alive comments, which
        # openai-python 1.x misreads as an empty event once an event carried an id (its last id is not reset).
        with gateway.http() as http, http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as r:
            for choice in completion_choices(r):
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                events += 1
                if events == 8:
                    victim.send(signal.SIGKILL)  # its record lingers in the DHT for ~25 s
                    # The session notices, finds no live node for 3:6 and waits — said by the metric — before any
                    # replacement exists; the replacement then takes seconds to load.
                    wait_for_metric(gateway, r'^swarmgate_failover_waiting_sessions\{blocks="3:6"\} 1\.0$')
                    local_swarm.wait_serving(local_swarm.start_node(tiny.folder, "3:6", *DISTANCE))
        assert text == expected and finish == "length"
        counters = swarm_json(gateway)["counters"]
        assert isinstance(counters, dict)
        # One failover: the dead node's lingering record was dialled once, never again while the session waited.
        assert counters["failovers"] == 1 and counters["departures"] == 1 and counters["bans"] == 0, counters
        with gateway.http() as http:
            assert 'blocks="3:6"' not in http.get("/metrics").text  # nobody waits any more
        assert "no live node serves blocks 3:6: waiting up to" in gateway.log_text()
    finally:
        stop_gracefully(local_swarm)


def test_a_burst_of_opens_beyond_a_nodes_pool_bans_nobody_and_every_request_completes(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("llama")
    expected = reference_text(tiny, 30)
    try:
        local_swarm.start_dht()
        # 100 tokens of room: two sessions of 7 + 30 tokens fit at once, the burst is three times that.
        local_swarm.start_nodes(tiny.folder, ["0:6"], "--cache-tokens", "100", *DISTANCE)
        gateway = start_gateway(local_swarm, tiny.folder)
        client = gateway.openai()

        def complete(_: int) -> str:
            result = client.completions.create(
                model=gateway.model, prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
            )
            return result.choices[0].text

        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(complete, range(6))) == [expected] * 6
        report = swarm_json(gateway)
        counters, nodes = report["counters"], report["nodes"]
        assert isinstance(counters, dict) and isinstance(nodes, list)
        assert counters["capacity_refusals"] > 0, counters  # the burst did overflow the pool
        assert counters["bans"] == 0 and counters["failovers"] == 0, counters
        assert not any(n["banned"] or n["consecutive_failures"] for n in nodes), nodes
        with gateway.http() as http:
            metrics = http.get("/metrics").text
        assert re.search(r"^swarmgate_bans_total 0\.0$", metrics, re.MULTILINE)
        assert re.search(r"^swarmgate_swarm_nodes_banned 0\.0$", metrics, re.MULTILINE)
        # Without --max-model-len the context is what the swarm can hold (the node's 100-token pool, not the model's
        # 256), so a request no node could ever hold is a 400 at once, not a wait for room that never comes.
        (card,) = client.models.list().data
        assert card.model_extra is not None and card.model_extra["max_model_len"] == 100
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=gateway.model, prompt=PROMPT, max_tokens=94)
        assert refused.value.code == "context_length_exceeded" and "maximum context length is 100" in str(refused.value)
    finally:
        stop_gracefully(local_swarm)


async def read_stream(gateway: Gateway, started: asyncio.Event, counter: list[int]) -> tuple[str, bool]:
    """One streamed completion read as an EventSource would: its text, and whether it ended with [DONE]."""
    body = {"model": gateway.model, "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}
    text, events = "", 0
    async with (
        gateway.async_http() as http,
        http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as r,
    ):
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # ids, blank lines, keep-alive comments
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return text, True
            chunk = json.loads(data)
            if "error" in chunk:
                return f"error: {chunk['error']}", False
            text += chunk["choices"][0]["text"]
            events += 1
            if events == 5:
                counter[0] += 1
                if counter[0] == STREAMS:
                    started.set()
    return text, False


STREAMS = 32
FREEZE_SECONDS = 40.0


@pytest.mark.soak  # ~2 minutes: `make test-soak`; a kill and a freeze mid-stream are in test_push, test_churn
async def test_32_streams_through_a_sigkill_and_a_40_second_freeze_all_complete_with_the_reference_text(
    local_swarm: LocalSwarm, tiny_with_tokenizer: GetTinyModel
) -> None:
    tiny = tiny_with_tokenizer("llama")
    expected = reference_text(tiny, 60)
    try:
        local_swarm.start_dht()
        nodes = []
        for span in ("0:3", "0:3", "3:6", "3:6"):  # one at a time: four p2p daemons starting at once on 2 busy cores
            nodes.append(local_swarm.start_node(tiny.folder, span, *DISTANCE))  # may miss hivemind's 15 s start limit
            await asyncio.to_thread(local_swarm.wait_serving, nodes[-1])
        gateway = await asyncio.to_thread(start_gateway, local_swarm, tiny.folder, "--routing", "max_throughput")
        started, counter = asyncio.Event(), [0]
        streams = [asyncio.create_task(read_stream(gateway, started, counter)) for _ in range(STREAMS)]
        async with asyncio.timeout(300):  # a stream that failed before its fifth token would leave this unset
            await started.wait()  # every stream is under way
        killed, frozen = nodes[0], nodes[2]  # max_throughput spread the sessions over both replicas of each span
        killed.send(signal.SIGKILL)
        frozen.send(signal.SIGSTOP)
        thaw = asyncio.get_running_loop().call_later(FREEZE_SECONDS, frozen.send, signal.SIGCONT)
        try:
            results = await asyncio.gather(*streams)
        finally:
            await asyncio.sleep(max(0.0, thaw.when() - asyncio.get_running_loop().time()))
            frozen.send(signal.SIGCONT)
        assert results == [(expected, True)] * STREAMS
        counters = (await asyncio.to_thread(swarm_json, gateway))["counters"]
        assert isinstance(counters, dict)
        assert counters["failovers"] >= 2 and counters["bans"] == 0, counters  # both were taken for gone
    finally:
        await asyncio.to_thread(stop_gracefully, local_swarm)
