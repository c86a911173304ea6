"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from gateway.api.dependencies import CompletionsDep, ContextDep, respond
from gateway.api.openapi_docs import errors, streamed
from gateway.api.protocol.completions import CompletionRequest, CompletionResponse

router = APIRouter(responses=errors(400, 401, 404, 409, 413, 429, 503))


@router.post(
    "/v1/completions", response_model=None, responses=streamed(CompletionResponse, json_model=CompletionResponse)
)
async def create_completion(body: CompletionRequest, serving: CompletionsDep, context: ContextDep) -> Response:
    return respond(await serving.create(body, context))
