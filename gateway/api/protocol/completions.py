"""OpenAI's legacy /v1/completions: request, response, and stream chunk (the same ``text_completion`` object)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field

from gateway.api.protocol.common import INTEGRAL, ResponseModel, SamplingFields, TokenId, Usage

# OpenAI's four shapes: a text, texts, token ids, lists of token ids (an empty list is no prompt at all).
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = 16  # null: the rest of the context window
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    best_of: Annotated[int, Field(ge=1, le=128), INTEGRAL] | None = None
    suffix: str | None = None


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # into prompt + completion, as OpenAI counts

    def extend(self, other: CompletionLogprobs) -> None:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(ResponseModel):
    """Both the whole response and each stream chunk (OpenAI uses one object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None
