"""GET /health (the process answers) and GET /ready (the swarm covers every block: requests can be served)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.dependencies import ModelsDep

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(serving: ModelsDep) -> dict[str, object]:
    return await serving.ready()
