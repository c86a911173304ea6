"""GET /health (the process answers), GET /ready (the swarm covers every block) and GET /v1/swarm (the view)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.dependencies import ModelsDep
from gateway.api.openapi_docs import errors

router = APIRouter(responses=errors())


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/v1/swarm")
async def swarm(serving: ModelsDep) -> dict[str, object]:
    """Per block: who serves it and in what state; per node: span, throughput, cache room, RTT, ban status."""
    return await serving.swarm()


@router.get("/ready", responses=errors(503))
async def ready(serving: ModelsDep) -> dict[str, object]:
    return await serving.ready()
