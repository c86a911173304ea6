"""OpenAI's /v1/chat/completions: request, response, and stream chunks."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from gateway.api.protocol import INTEGRAL, RequestModel, ResponseModel, SamplingFields, Usage


class ContentPart(RequestModel):
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(RequestModel):
    type: str = "text"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Deprecated by OpenAI in favour of max_completion_tokens.
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    response_format: ResponseFormat | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: Usage


class Delta(ResponseModel):
    """A stream chunk's change: OpenAI leaves out what did not change (the last delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(ResponseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
