"""Ollama's native API (/api/chat, /api/generate, /api/embed, /api/tags, ...): requests and responses as Ollama's own
clients send and read them (docs.ollama.com/api). Durations are nanoseconds; streams are NDJSON, one object a line.

Requests are lenient where Ollama is (numbers for integers, unknown top-level fields ignored, as Ollama's Go decoder
does); what would change the answer and is not implemented is refused by the serving layer in Ollama's error shape.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

OLLAMA_VERSION = "0.14.0"  # the Ollama API version whose shapes these are (clients gate features on it)


class OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="allow")


class Options(OllamaRequest):
    """The options we map onto our sampling; others are kept aside (``model_extra``) and judged by the serving layer."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    num_predict: int | None = None  # -1: no limit; -2: fill the context
    stop: list[str] | str | None = None
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(None, ge=1)


class ToolCallFunction(OllamaRequest):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not JSON text (unlike OpenAI)
    index: int | None = None


class ToolCall(OllamaRequest):
    function: ToolCallFunction
    id: str | None = None


class Message(OllamaRequest):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool message: which tool answered


JsonFormat = Literal["", "json"] | dict[str, Any]


class GenerationFields(OllamaRequest):
    model: str
    format: JsonFormat | None = None
    options: Options | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: float | str | None = None
    think: bool | str | None = None


class ChatRequest(GenerationFields):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class GenerateRequest(GenerationFields):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class EmbedRequest(OllamaRequest):
    model: str
    input: str | list[str]
    truncate: bool = True
    options: Options | None = None
    keep_alive: float | str | None = None
    dimensions: int | None = None


class LegacyEmbeddingsRequest(OllamaRequest):
    """/api/embeddings, the older one: one ``prompt``, one ``embedding``."""

    model: str
    prompt: str = ""
    options: Options | None = None
    keep_alive: float | str | None = None


class ShowRequest(OllamaRequest):
    model: str = ""
    name: str = ""  # the older field
    verbose: bool = False


# -- responses -------------------------------------------------------------------------------------------------


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class Timings(BaseModel):
    """What the final object of every generation carries, in nanoseconds (measured, docs/ollama.md)."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListedModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class RunningModel(ListedModel):
    expires_at: str
    size_vram: int
    context_length: int
