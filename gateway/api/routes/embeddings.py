"""POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.dependencies import ContextDep, EmbeddingsDep
from gateway.api.openapi_docs import errors
from gateway.api.protocol.embeddings import EmbeddingRequest, EmbeddingResponse

router = APIRouter(responses=errors(400, 401, 404, 413, 429, 503))


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, serving: EmbeddingsDep, context: ContextDep) -> EmbeddingResponse:
    return await serving.create(body, context)
