"""GET /health (liveness: the process answers), GET /ready (readiness: this process can answer requests; its body
says whether the swarm covers every block) and GET /v1/swarm (the view).

A gap in the swarm does not make a gateway unready: it answers 503 ``missing_blocks`` itself, which a load balancer
would otherwise turn into its own 502. ``GET /ready?swarm=complete`` is for scripts waiting for a usable swarm: 503
``missing_blocks`` until live nodes cover every block. Alert on the swarm with the coverage metrics instead.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

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


@router.get("/ready", responses=errors(400, 503))
async def ready(
    serving: ModelsDep,
    swarm: Annotated[
        Literal["any", "complete"] | None,
        Query(description="complete: 503 missing_blocks until live nodes cover every block (default: any)"),
    ] = None,
) -> dict[str, object]:
    """200 while this gateway can answer (503 ``draining`` once it stops); ``swarm`` in the body: coverage."""
    return await serving.ready(require_swarm=swarm == "complete")
