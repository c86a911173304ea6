"""Ollama's API on the gateway's port: /api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags, /api/show,
/api/ps, /api/version. Errors are Ollama's ``{"error": "..."}`` with the status our error tree gives (400, 404, 429,
503, 500); bodies are parsed here, not by FastAPI, so that a malformed one is answered in that shape too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from gateway.api.dependencies import ContextDep, services
from gateway.api.errors import InvalidRequest, as_api_error
from gateway.api.protocol.ollama import (
    ChatRequest,
    EmbedRequest,
    GenerateRequest,
    LegacyEmbeddingsRequest,
    ShowRequest,
)
from gateway.api.serving.common import RequestContext
from gateway.api.serving.ollama import OllamaServing
from gateway.api.serving.ollama_models import OllamaModels
from gateway.api.serving.ollama_output import NdjsonStream

# Not in the OpenAPI document, which is the OpenAI-shaped API (its errors, its fuzzing): docs/ollama.md is this one's.
router = APIRouter(tags=["ollama"], include_in_schema=False)

M = TypeVar("M", bound=BaseModel)


def _serving(request: Request) -> tuple[OllamaServing, OllamaModels]:
    found = services(request)
    return found.ollama, found.ollama_models


async def _parsed(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise InvalidRequest(f"{where or 'body'}: {first.get('msg', 'invalid')}", "invalid_value") from None


async def _answered(work: Callable[[], Awaitable[Any]]) -> Response:
    """The answer as JSON or an NDJSON stream; any failure as Ollama's error body."""
    try:
        result = await work()
    except Exception as exc:
        error = as_api_error(exc)
        return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)
    if isinstance(result, NdjsonStream):
        return StreamingResponse(result.lines, media_type="application/x-ndjson", headers={"X-Session-Id": result.id})
    return JSONResponse(result)


Answer = Callable[[M, RequestContext], Awaitable[Any]]


def _posted(
    body_type: type[M], answer: Callable[[OllamaServing, OllamaModels], Answer[M]]
) -> Callable[[Request, RequestContext], Awaitable[Response]]:
    """The endpoint of a POST route: its body parsed here (Ollama's error shape), answered by the serving method
    ``answer`` picks."""

    async def endpoint(request: Request, context: ContextDep) -> Response:
        async def work() -> Any:
            return await answer(*_serving(request))(await _parsed(request, body_type), context)

        return await _answered(work)

    return endpoint


router.post("/api/chat")(_posted(ChatRequest, lambda chat, _: chat.chat_answer))
router.post("/api/generate")(_posted(GenerateRequest, lambda chat, _: chat.generate_answer))
router.post("/api/embed")(_posted(EmbedRequest, lambda _, models: models.embed))
router.post("/api/embeddings")(_posted(LegacyEmbeddingsRequest, lambda _, models: models.legacy_embeddings))


@router.get("/api/tags")
async def tags(request: Request) -> Response:
    return await _answered(_serving(request)[1].tags)


@router.post("/api/show")
async def show(request: Request) -> Response:
    async def work() -> Any:
        return await _serving(request)[1].show(await _parsed(request, ShowRequest))

    return await _answered(work)


@router.get("/api/ps")
async def ps(request: Request) -> Response:
    return await _answered(_serving(request)[1].ps)


@router.get("/api/version")
async def version() -> Response:
    return JSONResponse(OllamaModels.version())
