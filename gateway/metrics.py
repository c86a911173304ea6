"""The gateway's Prometheus metrics, in vLLM's spirit under a ``swarmgate_`` prefix.

Request metrics are fed as a request lives (``RequestTimer``); swarm metrics are read from the engine's swarm
report at scrape time (``SwarmCollector``). Every app has its own ``CollectorRegistry``, so several apps in one
process (tests) never clash on metric names.

A request's timeline, from its arrival (the ``RequestRecord`` is made, after validation and tokenization):

    arrival ──queue time──▶ first chain of node sessions open ──prefill…──▶ first token ──ITL──▶ … ──▶ end
    └───────────────────────── time to first token ─────────────────────────┘
    └──────────────────────────────── end-to-end latency ───────────────────────────────────────────────┘

Queue time is routing plus waiting for the nodes to open a session (a node with a full cache pool makes the
gateway wait or route elsewhere): the time until the prompt's first forward step can start, like vLLM's time
spent waiting to be scheduled. With ``n`` choices, the first one to get its chain counts.

The timer of the request being served travels in a context variable, so the engine (``chain_opened``) and the
choice runners (``RequestTimer.token``) reach it without it being passed through the serving layer.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

NODE_STATES = ("joining", "online", "draining", "offline")
REACHABILITIES = ("direct", "relayed", "unreachable")

# Bucket bounds in seconds: a swarm on CPUs or across the internet is slower than one GPU, so they reach further.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
ACCEPTANCE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # accepted / drafted, per verify
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

SwarmReport = Callable[[], Awaitable[dict[str, Any]]]


class GatewayMetrics:
    """Every metric of one gateway app, in its own registry."""

    def __init__(self, swarm_report: SwarmReport | None = None) -> None:
        self.registry = CollectorRegistry()
        self._request_metrics(self.registry)
        self._speculation_metrics(self.registry)
        self.swarm = SwarmCollector(swarm_report)
        self.registry.register(self.swarm)

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Requests and tokens, and their latencies."""
        self.running = Gauge("swarmgate_requests_running", "requests being served now", registry=r)
        self.requests = Counter(
            "swarmgate_requests",
            "finished, failed and cancelled requests, by the finish reasons of their choices",
            ["endpoint", "status", "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("swarmgate_prompt_tokens", "prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter(
            "swarmgate_generation_tokens", "tokens generated (every choice, EOS included)", registry=r
        )
        self.ttft = _histogram(
            r, "swarmgate_time_to_first_token_seconds", "arrival to the first generated token", TTFT_BUCKETS
        )
        self.itl = _histogram(
            r, "swarmgate_inter_token_latency_seconds", "between consecutive tokens of one choice", ITL_BUCKETS
        )
        self.e2e = _histogram(
            r, "swarmgate_e2e_request_latency_seconds", "arrival to the end of requests that finished", E2E_BUCKETS
        )
        queued = "arrival until the first chain of node sessions is open (routing + waiting for node cache room)"
        self.queue = _histogram(r, "swarmgate_request_queue_time_seconds", queued, QUEUE_BUCKETS)

    def _speculation_metrics(self, r: CollectorRegistry) -> None:
        """Drafted and accepted tokens of speculative decoding."""
        self.spec_draft = Counter(
            "swarmgate_spec_draft_tokens", "draft tokens sent to the chain for verification (speculation)", registry=r
        )
        self.spec_accepted = Counter(
            "swarmgate_spec_accepted_tokens", "draft tokens the model's own sampling agreed with", registry=r
        )
        self.spec_acceptance = _histogram(
            r, "swarmgate_spec_acceptance_rate", "accepted / drafted tokens of each verify step", ACCEPTANCE_BUCKETS
        )


def _histogram(r: CollectorRegistry, name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(name, help_text, buckets=buckets, registry=r)


class RequestTimer:
    """One request's timeline; ``finish`` runs once, whatever way the request ends."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str, arrived: float) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._arrived = arrived
        self._scheduled = False
        self._first_token = False
        self._last_token: dict[int, float] = {}  # choice index -> when its previous token came
        self._finish_reasons: set[str] = set()
        self._open = True
        metrics.running.inc()

    def scheduled(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._metrics.queue.observe(time.monotonic() - self._arrived)

    def token(self, choice: int) -> None:
        now = time.monotonic()
        previous = self._last_token.get(choice)
        if previous is not None:
            self._metrics.itl.observe(now - previous)
        if not self._first_token:
            self._first_token = True
            self._metrics.ttft.observe(now - self._arrived)
        self._last_token[choice] = now
        self._metrics.generation_tokens.inc()

    def choice_finished(self, reason: str) -> None:
        self._finish_reasons.add(reason)

    def finish(self, status: str, prompt_tokens: int) -> None:
        """``status``: finished, failed or cancelled."""
        if not self._open:
            return
        self._open = False
        m = self._metrics
        m.running.dec()
        reasons = ",".join(sorted(self._finish_reasons)) if status == "finished" else ""
        m.requests.labels(self._endpoint, status, reasons or "none").inc()
        m.prompt_tokens.inc(prompt_tokens)
        if status == "finished":
            m.e2e.observe(time.monotonic() - self._arrived)


class SwarmCollector(Collector):
    """Swarm gauges and counters from the engine's latest swarm report (``refresh`` before each scrape)."""

    def __init__(self, swarm_report: SwarmReport | None) -> None:
        self._swarm_report = swarm_report
        self._latest: dict[str, Any] | None = None

    async def refresh(self) -> None:
        if self._swarm_report is None:
            return
        try:
            self._latest = await self._swarm_report()
        except Exception:
            # The request metrics are still worth scraping; the swarm gauges are left out until the view is back.
            logger.warning("no swarm report for /metrics", exc_info=True)
            self._latest = None

    def collect(self) -> Iterable[Metric]:
        if self._latest is None:
            return []
        return list(swarm_metrics(self._latest))


def swarm_metrics(report: dict[str, Any]) -> Iterable[Metric]:
    yield from _coverage_metrics(report.get("blocks", []))
    yield from _node_metrics(report.get("nodes", []))
    waiting = GaugeMetricFamily(
        "swarmgate_failover_waiting_sessions",
        "sessions that lost a node and wait for another to serve its blocks, by block range",
        labels=["blocks"],
    )
    for span, count in sorted(report.get("failover_waiting", {}).items()):
        waiting.add_metric([str(span)], count)
    yield waiting
    yield from _verification_metrics(report)
    yield from _swarm_counters(report.get("counters", {}))


def _coverage_metrics(blocks: list[dict[str, Any]]) -> Iterable[Metric]:
    live = [int(block.get("live", 0)) for block in blocks]
    yield _gauge("swarmgate_swarm_blocks", "blocks of the model", len(blocks))
    yield _gauge(
        "swarmgate_swarm_blocks_covered", "blocks served by at least one online node", sum(n > 0 for n in live)
    )
    yield _gauge("swarmgate_swarm_min_block_replicas", "online nodes of the least-served block", min(live, default=0))


def _node_metrics(nodes: list[dict[str, Any]]) -> Iterable[Metric]:
    states = GaugeMetricFamily("swarmgate_swarm_nodes", "nodes announcing themselves, by state", labels=["state"])
    for state in NODE_STATES:
        states.add_metric([state], sum(1 for node in nodes if node.get("state") == state))
    yield states
    reached = GaugeMetricFamily(
        "swarmgate_swarm_nodes_reachability",
        "nodes announcing themselves, by how peers reach them (direct, relayed, unreachable)",
        labels=["reachability"],
    )
    for how in REACHABILITIES:
        reached.add_metric([how], sum(1 for node in nodes if node.get("reachability") == how))
    yield reached
    yield _gauge(
        "swarmgate_swarm_nodes_banned", "nodes this gateway avoids now", sum(bool(n.get("banned")) for n in nodes)
    )


SWARM_COUNTERS = (
    ("failovers", "node sessions replaced mid-generation"),
    ("prefix_replays", "replacement node sessions replayed the lost node's inputs"),
    ("replayed_tokens", "tokens replayed into replacement node sessions"),
    ("bans", "times a node was banned after a fault (never for being full or draining)"),
    ("departures", "nodes taken out of routing until they announce again (dead, frozen, draining, moved)"),
    ("capacity_refusals", "session opens a full node refused (waited on or routed around, never banned)"),
    ("relayed_hops", "decode steps whose hidden states the gateway sent to a node"),
    ("pushed_hops", "decode steps whose hidden states went node to node (push)"),
    ("swarm_lookups", "DHT lookups of the swarm's records (the views routing reads)"),
    ("swarm_lookup_seconds", "seconds those DHT lookups took"),
    ("route_plans", "route choices planned (new sessions' routes, failovers' replacements)"),
    ("route_plan_seconds", "seconds spent choosing those routes, the swarm view in hand"),
    ("routes", "routing calls (a view, probes of new nodes, then the choice)"),
    ("route_seconds", "seconds of those routing calls, lookups and probes included"),
)


def _swarm_counters(counters: dict[str, float]) -> Iterable[Metric]:
    for name, help_text in SWARM_COUNTERS:
        yield CounterMetricFamily(f"swarmgate_{name}", help_text, value=counters.get(name, 0))


def _verification_metrics(report: dict[str, Any]) -> Iterable[Metric]:
    """Checks of nodes' outputs (docs/verification.md): by kind and result, by node and result, and reputations."""
    checks = CounterMetricFamily(
        "swarmgate_verification_checks", "checks of nodes' outputs, by kind and result", labels=["kind", "result"]
    )
    for row in report.get("checks", []):
        checks.add_metric([row["kind"], row["result"]], row["count"])
    yield checks
    by_node = CounterMetricFamily(
        "swarmgate_verification_node_checks", "spot checks each node took part in, by result", labels=["node", "result"]
    )
    reputation = GaugeMetricFamily("swarmgate_node_reputation", "each node's reputation (0..1)", labels=["node"])
    for node in report.get("nodes", []):
        verification = node.get("verification") or {}
        for result, count in verification.get("checks", {}).items():
            by_node.add_metric([node["peer_id"], result], count)
        if verification.get("reputation") is not None:
            reputation.add_metric([node["peer_id"]], verification["reputation"])
    yield by_node
    yield reputation


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


# The request being served, for code the request's tasks run (engine, choice runners); None outside requests.
_current_timer: contextvars.ContextVar[RequestTimer | None] = contextvars.ContextVar("request_timer", default=None)
# The app's metrics, set per request by the app's middleware (several apps may share a process).
current_metrics: contextvars.ContextVar[GatewayMetrics | None] = contextvars.ContextVar("metrics", default=None)


def start_request(endpoint: str, arrived: float) -> RequestTimer | None:
    """A timer for a request that arrived now, made current; None when no app metrics are in context."""
    metrics = current_metrics.get()
    timer = RequestTimer(metrics, endpoint, arrived) if metrics is not None else None
    _current_timer.set(timer)
    return timer


def current_timer() -> RequestTimer | None:
    return _current_timer.get()


def spec_verified(drafted: int, accepted: int) -> None:
    """One verify step of speculative decoding: ``accepted`` of its ``drafted`` draft tokens were kept."""
    metrics = current_metrics.get()
    if metrics is None or drafted <= 0:
        return
    metrics.spec_draft.inc(drafted)
    metrics.spec_accepted.inc(accepted)
    metrics.spec_acceptance.observe(accepted / drafted)


def chain_opened() -> None:
    """The engine has a chain of node sessions open for the current request (ends its queue time)."""
    timer = _current_timer.get()
    if timer is not None:
        timer.scheduled()
