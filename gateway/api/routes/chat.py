"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from gateway.api.dependencies import ChatDep, ContextDep, respond
from gateway.api.openapi_docs import errors, streamed
from gateway.api.protocol.chat import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse

router = APIRouter(responses=errors(400, 401, 404, 409, 413, 429, 503))


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses=streamed(ChatCompletionChunk, json_model=ChatCompletionResponse),
)
async def create_chat_completion(body: ChatCompletionRequest, serving: ChatDep, context: ContextDep) -> Response:
    return respond(await serving.create(body, context))
