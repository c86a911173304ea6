"""OpenAI's /v1/embeddings request and response (also the shapes Ollama's /api/embed is translated to)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gateway.api.protocol.common import INTEGRAL, RequestModel, ResponseModel, TokenId

# OpenAI's limit on the number of inputs of one request.
MAX_INPUTS = 2048

EmbeddingInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class EmbeddingRequest(RequestModel):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = "float"
    # Only the model's own width is served (docs/embeddings.md): a shorter vector would need a model trained for it.
    dimensions: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    user: str | None = None


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of the little-endian float32 values
    index: int


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
