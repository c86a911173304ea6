"""A process's Prometheus ``/metrics`` page, scraped and read by sample name and labels (gateway and nodes alike)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels; 0 where there is none (a counter not yet incremented is absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(url: str) -> Samples:
    """``url``'s ``/metrics`` (``url``: ``http://127.0.0.1:PORT``, a gateway's or a node's ``--metrics-port``)."""
    response = httpx.get(f"{url}/metrics", trust_env=False, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain"), response.text
    return parse(response.text)


def node_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"
