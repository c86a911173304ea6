"""OpenAI's /v1/responses: the request, its input items, and the response object with its output items.

Input items are one loose model (``type`` says which fields apply) because clients send OpenAI's many item shapes
and the translation to chat messages (``gateway.api.serving.responses_translate``) checks each kind it supports.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from gateway.api.protocol.chat import TokenLogprob
from gateway.api.protocol.common import INTEGRAL, RequestModel, ResponseModel

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- request -------------------------------------------------------------------------------------------------------


class InputContent(RequestModel):
    type: str  # input_text, output_text (a replayed assistant message), refusal; anything else is refused
    text: str | None = None
    refusal: str | None = None


class InputItem(RequestModel):
    type: str = "message"  # OpenAI's "easy" message items leave it out
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    namespace: str | None = None  # function_call of a tool inside a namespace tool
    output: str | list[InputContent] | None = None  # function_call_output
    encrypted_content: str | None = None  # compaction (what /v1/responses/compact returned)


class FunctionTool(RequestModel):
    type: str  # "function", or "namespace" of functions; built-in tools (web_search, file_search, ...) are refused
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's own tools

    def echoed(self) -> dict[str, Any]:
        """As the response object lists it: a function with every field the spec's ``FunctionTool`` requires
        (``description``, ``parameters`` and ``strict`` null where the request left them out); a namespace (an
        OpenAI extension the spec does not list) as it came."""
        if self.type == "namespace":
            return self.model_dump(exclude_none=True)
        return self.model_dump(include={"type", "name", "description", "parameters", "strict"})


class NamedToolChoice(RequestModel):
    type: str
    name: str | None = None


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def echoed(self) -> dict[str, Any]:
        """As the response object's ``text.format`` shows it: a JSON schema with every field the spec requires,
        ``strict`` as applied (true: the grammar holds the output to the schema whatever the request said)."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": self.type, "name": self.name, "description": self.description, "schema": self.schema_,
                "strict": True}  # fmt: skip


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint to OpenAI's own models; answers here do not depend on it

    def echoed(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"format": (self.format or TextFormat()).echoed()}
        if self.verbosity is not None:
            shown["verbosity"] = self.verbosity
        return shown


class Reasoning(RequestModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    # vLLM's sampling extensions, as on the chat endpoint.
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: Annotated[int, Field(ge=-(2**53), le=2**53), INTEGRAL] | None = None
    store: bool | None = True
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Bookkeeping the response object echoes; none of it changes the answer.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # Known fields this gateway does not implement: a value that would change the answer is a 400.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None  # a conversation id, or {"id": ...}
    prompt: Any = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    truncation: str | None = None
    max_tool_calls: Annotated[int, Field(ge=1), INTEGRAL] | None = None


# -- response ------------------------------------------------------------------------------------------------------


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)  # include: ["message.output_text.logprobs"]


Phase = Literal["commentary", "final_answer"]


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    status: ItemStatus = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)
    # Known once the message ends: "commentary" when tool calls follow it, "final_answer" when it ends the turn.
    phase: Phase | None = None

    @model_serializer(mode="wrap")
    def _without_unknown_phase(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("phase") is None:  # the spec's phase is one of its values or absent, never null
            data.pop("phase", None)
        return data


class FunctionCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str = Field(default_factory=lambda: item_id("call"))
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"
    namespace: str | None = None  # the namespace tool the function belongs to

    @model_serializer(mode="wrap")
    def _without_namespace(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("namespace") is None:  # a plain function's call has no namespace field at all (as OpenAI's)
            data.pop("namespace", None)
        return data

    @property
    def flat_name(self) -> str:
        """The name the model knows it by: a namespace's functions are ``namespace.name``."""
        return self.name if self.namespace is None else f"{self.namespace}.{self.name}"


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(ResponseModel):
    """What a model that thinks in tags (``<think>``) thought before answering (the chat path's reasoning_content)."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: item_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


OutputItem = OutputMessage | FunctionCall | ReasoningItem


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens the nodes held from the previous response (not computed again)


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        )


class ResponseError(ResponseModel):
    code: str
    message: str


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ConversationRef(ResponseModel):
    id: str


class ResponseObject(ResponseModel):
    """Every field the Open Responses ``ResponseResource`` requires, with the values this response was made with."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: ResponseStatus = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    max_tool_calls: int | None = None
    service_tier: str = "default"
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    conversation: ConversationRef | None = None

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage) for part in item.content)


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class CompactRequest(RequestModel):
    """``POST /v1/responses/compact``: the conversation to compact (``previous_response_id``, then ``input``)."""

    model: str
    input: str | list[InputItem] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None  # how to compact (the default asks for goals, facts, decisions and open tasks)


class CompactionItem(ResponseModel):
    """The summary of what the compacted conversation said, opaque to clients: they send it back as an input item.
    Not encrypted here (the gateway has no secret to hide it from its own caller); it only round-trips."""

    type: Literal["compaction"] = "compaction"
    id: str = Field(default_factory=lambda: item_id("cmp"))
    encrypted_content: str
    status: Literal["completed"] = "completed"


class UserMessageItem(ResponseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    status: Literal["completed"] = "completed"
    role: Literal["user"] = "user"
    content: list[dict[str, str]]


class CompactedResponse(ResponseModel):
    id: str = Field(default_factory=response_id)
    object: Literal["response.compaction"] = "response.compaction"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    output: list[UserMessageItem | CompactionItem]
    usage: ResponseUsage


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response; ``type`` says which, and which other fields it has."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
