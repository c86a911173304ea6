"""GET /: the swarm page — coverage per block, nodes, health — refreshing itself from GET /v1/swarm."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from gateway.api.swarm_page import PAGE

router = APIRouter()


@router.get("/", include_in_schema=False)
async def swarm_page() -> HTMLResponse:
    return HTMLResponse(PAGE)
