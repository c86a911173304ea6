"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.dependencies import CompletionsDep, disconnect_waiter, respond
from gateway.api.protocol_completions import CompletionRequest

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request, serving: CompletionsDep) -> Response:
    return respond(await serving.create(body, disconnect_waiter(request)))
