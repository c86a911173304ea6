"""GET /v1/models and GET /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.dependencies import ModelsDep
from gateway.api.openapi_docs import errors
from gateway.api.protocol.common import ModelCard, ModelList

router = APIRouter(responses=errors(401))


@router.get("/v1/models")
async def list_models(serving: ModelsDep) -> ModelList:
    return await serving.models()


@router.get("/v1/models/{model:path}", responses=errors(404))
async def retrieve_model(model: str, serving: ModelsDep) -> ModelCard:
    return await serving.model(model)
