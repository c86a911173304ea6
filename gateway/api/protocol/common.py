"""OpenAI protocol models shared by the endpoints: errors, usage, models list, tokenize/detokenize.

Request models keep unknown fields aside (``model_extra``) and the serving layer answers 400
``unsupported_parameter`` naming the first one (``reject_unsupported``), unless it is in ``IGNORED_FIELDS``: fields
that cannot change the result (``user``, ``store``, ``metadata``, ...). Nothing that would change the output is
dropped silently. The fields they know are checked as OpenAI does: strict types (``"2"`` is not an integer,
``1`` not a boolean) and finite numbers (Python's json reads ``NaN``), so
that every constraint a client can see in the OpenAPI spec is the one enforced. Response models carry OpenAI's field
names and nulls exactly, since clients index into them.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


# Top-level request fields accepted and ignored: none of them changes what is generated.
IGNORED_FIELDS = frozenset(
    {
        "user",  # an end-user id for abuse tracking
        "store",  # OpenAI's stored completions (we keep sessions in Redis anyway)
        "metadata",  # tags for stored completions
        "service_tier",  # OpenAI's latency tier
        "prompt_cache_key",  # OpenAI's cache routing hint (our caches are keyed by the conversation itself)
        "safety_identifier",  # the newer name of ``user``
    }
)


class UnsupportedParameter(ValueError):
    """A request field that would change the result and is not implemented (400 ``unsupported_parameter``)."""

    def __init__(self, param: str) -> None:
        super().__init__(f"Unsupported parameter: '{param}' is not supported by this server.")
        self.param = param


def reject_unsupported(body: BaseModel, ignored: frozenset[str] = IGNORED_FIELDS) -> None:
    """Raise ``UnsupportedParameter`` for the first field of ``body`` that no model field and no ignore names."""
    for name in body.model_extra or {}:
        if name not in ignored:
            raise UnsupportedParameter(name)


def _integral(value: object) -> object:
    """JSON Schema (and so the spec) counts ``2.0`` as an integer: take it as 2, but never 2.5, "2" or true."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# After an int's bounds in ``Annotated`` (before them, pydantic writes its own "ge"/"le" into the JSON schema).
INTEGRAL = BeforeValidator(_integral)
# The upper bound is the served model's vocabulary, checked when serving.
TokenId = Annotated[int, Field(ge=0), INTEGRAL]
# OpenAI's logit_bias range; keys are token ids as strings (checked against the vocabulary when serving).
LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100)]]


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


class PromptTokensDetails(ResponseModel):
    cached_tokens: int  # prompt tokens not computed again: the nodes held them from the conversation's last turn


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # chat only, as OpenAI's (left out, not null, otherwise)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens),
        )

    @model_serializer(mode="wrap")
    def _without_missing_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        data: dict[str, object] = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class SamplingFields(RequestModel):
    """Sampling parameters both generation endpoints take (OpenAI's, plus vLLM's top_k/min_p/… extensions)."""

    model: str
    n: Annotated[int, Field(ge=1, le=128), INTEGRAL] | None = 1
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None  # 0 or -1: no limit
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    # ±2**53: what JSON clients in JavaScript hold exactly, and what FastAPI's spec (bounds as floats) states exactly.
    seed: Annotated[int, Field(ge=-(2**53), le=2**53), INTEGRAL] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # vLLM's range; a tinier or huger one is 0 or inf in float32 logits, and the sampler's probabilities NaN.
    repetition_penalty: float | None = Field(None, ge=0.01, le=2)
    logit_bias: LogitBias | None = None
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
    root: str | None = None  # vLLM's: what the model is served from (an adapter's: its own name)
    parent: str | None = None  # an adapter's base model (vLLM's field); None for the base model itself
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
    tokens: list[TokenId]


class DetokenizeResponse(ResponseModel):
    prompt: str
