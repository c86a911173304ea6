"""Metrics and the swarm page of a real swarm: `gateway serve` and two nodes with `--metrics-port`, on 127.0.0.1.

One swarm per module: a DHT, two nodes (blocks 0:3 and 3:6) of the tiny Llama and the gateway. The page test runs
last: it stops a node and watches the page (in headless Chromium) redraw the coverage bar without a reload.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.browser import Browser, find_chromium
from tests.helpers.gateway import Gateway, start_gateway, stop_gracefully
from tests.helpers.processes import LocalSwarm, ManagedProcess
from tests.helpers.prometheus import Samples, scrape, value
from tests.helpers.redis_server import free_port
from tests.integration.conftest import CONTEXT
from tests.tiny_models import TinyModel

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SPANS = ("0:3", "3:6")
AMBER, RED = (240, 162, 2), (198, 40, 40)  # the page's colours for blocks with one and with no online node


@pytest.fixture(scope="module")
def swarm(module_swarm: LocalSwarm, chat_model: TinyModel) -> Iterator[tuple[Gateway, dict[str, int]]]:
    """The gateway and each node's metrics port, by span."""
    try:
        module_swarm.start_dht()
        ports = {span: free_port() for span in SPANS}
        nodes = [
            module_swarm.start_node(chat_model.folder, span, "--cache-tokens", "8192", "--metrics-port", str(port))
            for span, port in ports.items()
        ]
        for node in nodes:
            module_swarm.wait_serving(node)
        yield start_gateway(module_swarm, chat_model.folder, "--step-timeout", "10"), ports
    finally:
        stop_gracefully(module_swarm)


def wait_until(check: Callable[[Samples], bool], url: str, timeout: float = 30.0) -> Samples:
    """Scrape ``url`` until ``check(samples)`` holds; returns those samples."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


async def _cancelled_stream(gateway: Gateway) -> None:
    """A stream the client drops after its first token (the connection closes mid-generation)."""
    body = {"model": gateway.model, "prompt": [1, 2, 3], "max_tokens": CONTEXT - 3, "stream": True}
    async with gateway.async_http() as client, client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break


def test_gateway_metrics_after_finished_and_cancelled_requests(swarm: tuple[Gateway, dict[str, int]]) -> None:
    gateway, _ = swarm
    body = {"model": gateway.model, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with gateway.http() as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert [line for line in response.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    asyncio.run(_cancelled_stream(gateway))

    cancelled = {"endpoint": "completions", "status": "cancelled", "finish_reason": "none"}
    samples = wait_until(lambda s: value(s, "swarmgate_requests_total", **cancelled) == 1, gateway.url)
    assert value(samples, "swarmgate_requests_total", **cancelled) == 1, gateway.log_text()[-3000:]
    assert value(samples, "swarmgate_requests_running") == 0
    finished = {"endpoint": "completions", "status": "finished", "finish_reason": "length"}
    assert value(samples, "swarmgate_requests_total", **finished) == 2
    assert value(samples, "swarmgate_prompt_tokens_total") == 9
    assert value(samples, "swarmgate_generation_tokens_total") >= 4 + 4 + 1
    assert value(samples, "swarmgate_time_to_first_token_seconds_count") == 3
    assert value(samples, "swarmgate_request_queue_time_seconds_count") == 3
    assert value(samples, "swarmgate_e2e_request_latency_seconds_count") == 2  # finished requests only
    assert value(samples, "swarmgate_inter_token_latency_seconds_count") >= 3 + 3
    assert value(samples, "swarmgate_time_to_first_token_seconds_sum") > 0
    # The swarm as the gateway sees it.
    assert value(samples, "swarmgate_swarm_blocks") == value(samples, "swarmgate_swarm_blocks_covered") == 6
    assert value(samples, "swarmgate_swarm_min_block_replicas") == 1
    assert value(samples, "swarmgate_swarm_nodes", state="online") == 2
    assert value(samples, "swarmgate_swarm_nodes_banned") == 0
    assert value(samples, "swarmgate_failovers_total") == value(samples, "swarmgate_prefix_replays_total") == 0


def test_nodes_export_their_own_metrics(swarm: tuple[Gateway, dict[str, int]]) -> None:
    _, ports = swarm
    for span, port in ports.items():
        url = f"http://127.0.0.1:{port}"
        samples = wait_until(lambda s: value(s, "swarmgate_node_sessions_open") == 0, url)  # the cancelled stream
        start, end = map(int, span.split(":"))
        assert value(samples, "swarmgate_node_span_start") == start and value(samples, "swarmgate_node_span_end") == end
        assert value(samples, "swarmgate_node_cache_capacity_tokens") == 8192
        assert value(samples, "swarmgate_node_cache_used_tokens") == 0
        assert value(samples, "swarmgate_node_sessions_open") == 0
        assert value(samples, "swarmgate_node_state", state="online") == 1
        assert value(samples, "swarmgate_node_state", state="draining") == 0
        assert value(samples, "swarmgate_node_decode_batch_size_count") >= 3 + 3  # decode steps of the requests
        assert value(samples, "swarmgate_node_step_latency_seconds_count", kind="decode") >= 6
        assert value(samples, "swarmgate_node_step_latency_seconds_count", kind="prefill") >= 3
        assert value(samples, "swarmgate_node_forward_tokens_total", kind="prefill") >= 9


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed by scripts/install-browser.sh (as `make test` does) when missing."""
    if find_chromium() is None:
        subprocess.run(["bash", str(ROOT / "scripts/install-browser.sh")], capture_output=True, check=False)
    found = find_chromium()
    if found is None:
        pytest.skip("no chromium: scripts/install-browser.sh needs root and Debian's apt to install it")
    return found


BLOCKS_JS = "[...document.querySelectorAll('#coverage .block')].map(b => b.dataset.live).join(',')"
CENTRE_JS = "(() => {{ const r = document.querySelector('#coverage [data-block=\"{}\"]').getBoundingClientRect();"
CENTRE_JS += " return [r.x + r.width / 2, r.y + r.height / 2]; }})()"


def _node(swarm: LocalSwarm, span: str) -> ManagedProcess:
    (node,) = [p for p in swarm.processes if p.name.startswith(f"node-{span.replace(':', '-')}")]
    return node


@pytest.mark.browser
def test_the_page_shows_coverage_and_redraws_when_a_node_stops(
    swarm: tuple[Gateway, dict[str, int]], module_swarm: LocalSwarm, chromium: str, tmp_path: Path
) -> None:
    """Runs last: stops the node of blocks 3:6; its blocks turn red on the open page, and requests then fail."""
    gateway, _ = swarm
    browser = Browser(chromium)
    try:
        browser.open(f"{gateway.url}/")
        assert browser.wait_for(f"{BLOCKS_JS} === '1,1,1,1,1,1'")
        assert browser.evaluate("document.getElementById('status').textContent") == "ready"
        rows = browser.evaluate("[...document.querySelectorAll('#nodes tr')].map(r => r.dataset.state)")
        assert rows == ["online", "online"]
        browser.evaluate("window.loadedOnce = true")  # gone if the page were reloaded
        browser.screenshot(tmp_path / "swarm-page.png")
        assert (tmp_path / "swarm-page.png").read_bytes().startswith(b"\x89PNG")
        assert [browser.pixel(*browser.evaluate(CENTRE_JS.format(b))) for b in (0, 4)] == [AMBER, AMBER]

        assert _node(module_swarm, "3:6").stop() == 0  # graceful: it announces OFFLINE, then exits
        assert browser.wait_for(f"{BLOCKS_JS} === '1,1,1,0,0,0'", timeout=60)
        assert browser.evaluate("window.loadedOnce") is True
        assert browser.evaluate("document.getElementById('status').textContent") == "missing blocks"
        browser.screenshot(tmp_path / "swarm-page-node-stopped.png")
        assert [browser.pixel(*browser.evaluate(CENTRE_JS.format(b))) for b in (0, 4)] == [AMBER, RED]
    finally:
        browser.close()

    # A request now fails (no node serves blocks 3:6) and leaves the in-flight gauge at zero too.
    with gateway.http() as client:
        body = {"model": gateway.model, "prompt": [1, 2, 3], "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 503
    samples = scrape(gateway.url)
    failed = {"endpoint": "completions", "status": "failed", "finish_reason": "none"}
    assert value(samples, "swarmgate_requests_total", **failed) == 1
    assert value(samples, "swarmgate_requests_running") == 0
    assert value(samples, "swarmgate_swarm_blocks_covered") == 3
    assert value(samples, "swarmgate_swarm_min_block_replicas") == 0
