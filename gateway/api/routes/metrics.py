"""GET /metrics: Prometheus text of the gateway's request and swarm metrics (see gateway.metrics)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.api.metrics_http import app_metrics

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    found = app_metrics(request)
    await found.swarm.refresh()  # the swarm gauges come from the engine's view, read now
    return Response(generate_latest(found.registry), media_type=CONTENT_TYPE_LATEST)
