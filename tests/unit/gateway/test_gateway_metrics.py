"""GET /metrics over a scripted engine (a seam): request lifecycles, the in-flight gauge, swarm gauges, GET /.

The same over a real swarm, with a real client disconnect, is tests/integration/test_observability.py.
"""

from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.request_log import RequestRecord
from gateway.api.serving.common import ServingConfig
from gateway.app import create_app
from gateway.metrics import GatewayMetrics, current_metrics
from shared.errors import MissingBlocks, NodeUnreachable
from tests.helpers.scripted_engine import CharCodec, ScriptedEngine, content_of

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class ChatCharCodec(CharCodec):
    """The scripted codec with a trivial chat template (chat requests reach the engine)."""

    chat_message = staticmethod(content_of)
    chat_sep = " "


REPORT: dict[str, Any] = {
    "model": "scripted",
    "num_blocks": 4,
    "ready": False,
    "missing_blocks": [3],
    "blocks": [{"block": i, "live": live, "servers": []} for i, live in enumerate([2, 1, 1, 0])],
    "nodes": [
        {"peer_id": "A", "start": 0, "end": 3, "state": "online", "banned": False},
        {"peer_id": "B", "start": 0, "end": 1, "state": "online", "banned": True},
        {"peer_id": "C", "start": 3, "end": 4, "state": "draining", "banned": False},
    ],
    "counters": {"failovers": 3, "prefix_replays": 2, "replayed_tokens": 40, "bans": 3},
}


@dataclass
class ReportingEngine(ScriptedEngine):
    """The scripted engine, able to chat, with a fixed swarm report."""

    codec: CharCodec = field(default_factory=ChatCharCodec)

    async def swarm_report(self) -> dict[str, Any]:
        return REPORT


def client_for(engine: ReportingEngine) -> httpx.AsyncClient:
    app = create_app(engine, ServingConfig(engine.model_name))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def completion(**fields: object) -> dict[str, object]:
    return {"model": "scripted", "prompt": "ab", "max_tokens": 5, **fields}


async def test_requests_are_counted_timed_and_leave_the_in_flight_gauge_at_zero() -> None:
    engine = ReportingEngine()
    async with client_for(engine) as client:
        assert (await client.post("/v1/completions", json=completion())).status_code == 200
        assert (await client.post("/v1/completions", json=completion(stream=True, n=2))).status_code == 200
        chat = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        engine.failure = MissingBlocks([3])  # fails before its first token: a 503
        assert (await client.post("/v1/completions", json=completion())).status_code == 503
        engine.failure, engine.fail_at = NodeUnreachable("lost"), 2  # fails mid-stream: a final error event
        assert (await client.post("/v1/completions", json=completion(stream=True))).status_code == 200
        samples = await scrape(client)

    assert value(samples, "swarmgate_requests_running") == 0
    assert (
        value(samples, "swarmgate_requests_total", endpoint="completions", status="finished", finish_reason="length")
        == 2
    )
    assert value(samples, "swarmgate_requests_total", endpoint="chat", status="finished", finish_reason="length") == 1
    assert (
        value(samples, "swarmgate_requests_total", endpoint="completions", status="failed", finish_reason="none") == 2
    )
    # 5 + 2 x 5 + 11 ("hello world" ends before 50) + 0 + 2 tokens; prompts: 2 + 2 + 2 ("hi") + 2 + 2.
    assert value(samples, "swarmgate_generation_tokens_total") == 28
    assert value(samples, "swarmgate_prompt_tokens_total") == 10
    assert value(samples, "swarmgate_time_to_first_token_seconds_count") == 4  # every request with a token
    assert value(samples, "swarmgate_inter_token_latency_seconds_count") == 28 - 5  # tokens after each choice's 1st
    assert value(samples, "swarmgate_e2e_request_latency_seconds_count") == 3  # finished requests only
    assert value(samples, "swarmgate_time_to_first_token_seconds_bucket", le="+Inf") == 4


async def test_swarm_gauges_come_from_the_engine_report_at_scrape_time() -> None:
    async with client_for(ReportingEngine()) as client:
        samples = await scrape(client)
    assert value(samples, "swarmgate_swarm_blocks") == 4
    assert value(samples, "swarmgate_swarm_blocks_covered") == 3
    assert value(samples, "swarmgate_swarm_min_block_replicas") == 0
    assert value(samples, "swarmgate_swarm_nodes", state="online") == 2
    assert value(samples, "swarmgate_swarm_nodes", state="draining") == 1
    assert value(samples, "swarmgate_swarm_nodes", state="offline") == 0
    assert value(samples, "swarmgate_swarm_nodes_banned") == 1
    assert value(samples, "swarmgate_failovers_total") == 3
    assert value(samples, "swarmgate_prefix_replays_total") == 2
    assert value(samples, "swarmgate_replayed_tokens_total") == 40
    assert value(samples, "swarmgate_bans_total") == 3


async def test_each_app_has_its_own_registry() -> None:
    async with client_for(ReportingEngine()) as first, client_for(ReportingEngine()) as second:
        assert (await first.post("/v1/completions", json=completion())).status_code == 200
        assert value(await scrape(first), "swarmgate_prompt_tokens_total") == 2
        assert value(await scrape(second), "swarmgate_prompt_tokens_total") == 0


async def test_a_cancelled_or_abandoned_request_leaves_the_in_flight_gauge() -> None:
    metrics = GatewayMetrics()
    current_metrics.set(metrics)

    def running() -> float | None:
        return metrics.registry.get_sample_value("swarmgate_requests_running")

    def cancelled() -> float | None:
        labels = {"endpoint": "completions", "status": "cancelled", "finish_reason": "none"}
        return metrics.registry.get_sample_value("swarmgate_requests_total", labels)

    async def serve_forever() -> None:
        record = RequestRecord("cmpl-1", "completions", 1, 3)
        async with record.tracking():
            await asyncio.sleep(3600)

    task = asyncio.create_task(serve_forever())
    await asyncio.sleep(0.01)
    assert running() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert running() == 0
    assert cancelled() == 1

    # A stream whose generator never ran (the client left before it started) never enters ``tracking``.
    RequestRecord("cmpl-2", "completions", 1, 3)
    gc.collect()
    assert running() == 0
    assert cancelled() == 2


async def test_the_swarm_page_is_served_without_an_api_key() -> None:
    async with client_for(ReportingEngine()) as client:
        response = await client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert 'fetch("v1/swarm"' in response.text and 'id="coverage"' in response.text
