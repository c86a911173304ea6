"""POST /tokenize and POST /detokenize (vLLM's shapes)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api.dependencies import ModelsDep
from gateway.api.openapi_docs import errors
from gateway.api.protocol.chat import TokenizeRequest
from gateway.api.protocol.common import DetokenizeRequest, DetokenizeResponse, TokenizeResponse

router = APIRouter(responses=errors(400, 401, 404, 413))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: ModelsDep) -> TokenizeResponse:
    return await serving.tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: ModelsDep) -> DetokenizeResponse:
    return await serving.detokenize(body)
