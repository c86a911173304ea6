"""The app's metrics over HTTP: its registry made current for each request (``current_metrics``), and its lookup."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.generation import Engine
from gateway.metrics import GatewayMetrics, current_metrics


class MetricsContext:
    """Pure ASGI middleware: requests of this app record into this app's metrics (apps may share a process)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = current_metrics.set(self.metrics)
        try:
            await self.app(scope, receive, send)
        finally:
            current_metrics.reset(token)


def install_metrics(app: FastAPI, engine: Engine) -> GatewayMetrics:
    metrics = GatewayMetrics(lambda: engine.swarm_report())  # looked up per scrape: test engines may lack it
    app.state.metrics = metrics
    app.add_middleware(MetricsContext, metrics=metrics)
    return metrics


def app_metrics(request: Request) -> GatewayMetrics:
    found = request.app.state.metrics
    if not isinstance(found, GatewayMetrics):
        raise RuntimeError("the app was built without metrics (use gateway.app.create_app)")
    return found
