"""OpenAI protocol models shared by the endpoints: errors, usage, models list, tokenize/detokenize.

Request models ignore unknown fields (clients send vendor extensions); response models carry OpenAI's field names
and nulls exactly, since clients index into them.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class StreamOptions(RequestModel):
    include_usage: bool | None = False


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class SamplingFields(RequestModel):
    """Sampling parameters both generation endpoints take (OpenAI's, plus vLLM's top_k/min_p/… extensions)."""

    model: str
    n: int | None = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: no limit
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "swarmgate"
    context_length: int  # what chat frontends read to size conversations
    max_model_len: int  # vLLM's name for the same, read by some clients


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str
