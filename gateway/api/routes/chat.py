"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.dependencies import ChatDep, disconnect_waiter, respond
from gateway.api.protocol_chat import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, serving: ChatDep) -> Response:
    return respond(await serving.create(body, disconnect_waiter(request)))
