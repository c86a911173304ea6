"""The node's Prometheus metrics (``swarm_node serve --metrics-port``): cache room, sessions, batching, step time.

Forwards are observed as they run (on the compute thread: prometheus-client's metrics are thread-safe); cache,
session, queue and state gauges are read from the node's objects at scrape time. The same small HTTP server, on
daemon threads, bound to ``--metrics-host`` (127.0.0.1 by default), answers the node's probes too:
``GET /health`` 200 while the process runs (liveness), ``GET /ready`` 200 only once the span is loaded and
announced ONLINE, 503 while joining, loading, moving or draining (readiness). Any other path is the metrics.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.dht_records import NodeState

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
# One forward of a span: from a few ms (small span, GPU) to seconds (a long prompt chunk on a CPU).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class NodeGauges:
    """Where the scrape-time gauges come from (plain callables: the node's objects change as it moves)."""

    cache_tokens_total: Callable[[], int]
    cache_tokens_left: Callable[[], int]
    sessions_open: Callable[[], int]
    queue_depth: Callable[[], int]
    state: Callable[[], NodeState]
    span: Callable[[], tuple[int, int]]


class NodeMetrics:
    def __init__(self, gauges: NodeGauges) -> None:
        self.registry = CollectorRegistry()
        self.batch_size = Histogram(
            "swarmgate_node_decode_batch_size",
            "sessions' decode steps merged into one forward",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "swarmgate_node_step_latency_seconds",
            "one forward of the span on the compute thread (decode: a batch of one-token steps; prefill: a chunk)",
            ["kind"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "swarmgate_node_forward_tokens",
            "token positions computed through the span",
            ["kind"],
            registry=self.registry,
        )
        self.registry.register(_GaugeCollector(gauges))

    def forward(self, rows: int, tokens_per_row: int, seconds: float) -> None:
        kind = "decode" if tokens_per_row == 1 else "prefill"
        self.step_seconds.labels(kind).observe(seconds)
        self.tokens.labels(kind).inc(rows * tokens_per_row)

    def decode_batch(self, rows: int) -> None:
        self.batch_size.observe(rows)

    def serve(self, host: str, port: int, readiness: Callable[[], tuple[bool, str]]) -> WSGIServer:
        """Metrics and probes on ``host:port`` (0: any free port), from daemon threads; ``shutdown()`` stops it."""
        app = _with_probes(make_wsgi_app(self.registry), readiness)
        server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
        server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="node-metrics", daemon=True).start()
        logger.info("metrics on http://%s:%d/metrics (probes: /health, /ready)", host, server.server_port)
        return server


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _with_probes(metrics: WSGIApp, readiness: Callable[[], tuple[bool, str]]) -> WSGIApp:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/health":
            ok, detail = True, "alive"
        elif path == "/ready":
            ok, detail = readiness()
        else:
            return metrics(environ, start_response)
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")])
        return [detail.encode() + b"\n"]

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scrape never keeps the node from exiting


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Probes every few seconds would flood the log."""


class _GaugeCollector(Collector):
    def __init__(self, gauges: NodeGauges) -> None:
        self._gauges = gauges

    def collect(self) -> Iterable[Metric]:
        g = self._gauges
        total, left = g.cache_tokens_total(), g.cache_tokens_left()
        start, end = g.span()
        yield GaugeMetricFamily("swarmgate_node_cache_capacity_tokens", "KV-cache pool size, in tokens", total)
        yield GaugeMetricFamily(
            "swarmgate_node_cache_used_tokens", "KV-cache tokens reserved by sessions", total - left
        )
        yield GaugeMetricFamily(
            "swarmgate_node_sessions_open", "open sessions (and stateless forwards in flight)", value=g.sessions_open()
        )
        yield GaugeMetricFamily(
            "swarmgate_node_queue_depth", "steps waiting for or on the compute thread", g.queue_depth()
        )
        yield GaugeMetricFamily("swarmgate_node_span_start", "first block served", value=start)
        yield GaugeMetricFamily("swarmgate_node_span_end", "block after the last one served", value=end)
        state = GaugeMetricFamily("swarmgate_node_state", "1 for the node's current state", labels=["state"])
        current = g.state()
        for candidate in NodeState:
            state.add_metric([candidate.value], 1 if candidate is current else 0)
        yield state
