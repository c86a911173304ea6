"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): requests, the message object, and
the token count.

Content blocks are one loose model (``type`` says which fields apply), as input items are for /v1/responses: clients
send Anthropic's many block shapes and ``gateway.api.serving.messages_translate`` checks each kind it serves, naming
the field of any it refuses (images, documents, server tools) instead of failing on the union's first mismatch.
Response models carry Anthropic's field names and nulls exactly (``stop_sequence: null``), since the SDKs read them.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from gateway.api.protocol.common import INTEGRAL, RequestModel, ResponseModel


def message_id() -> str:
    """The message's id, which is also its session's (``/v1/sessions/{id}``: list, events, cancel)."""
    return f"msg_{uuid.uuid4().hex}"


# -- request -------------------------------------------------------------------------------------------------------


class ContentBlock(RequestModel):
    type: str  # text, tool_use, tool_result, thinking, redacted_thinking are served; anything else is refused
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use: the call's arguments (an object)
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result: a string or text blocks
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking: checked by Anthropic's servers only; ours sign nothing
    data: str | None = None  # redacted_thinking: encrypted by Anthropic, opaque to any other model
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: the nodes keep caches by themselves
    citations: Any = None  # on text blocks a client replays: where the text came from, no input to the model
    caller: Any = None  # on a replayed tool_use: who made the call (always the model itself here)
    toolset_name: str | None = None  # on a replayed tool_use / tool_result: bookkeeping of Anthropic's toolsets


class InputMessage(RequestModel):
    role: Literal["user", "assistant", "system"]  # system: an instruction at its place in the conversation
    content: str | list[ContentBlock]


class Tool(RequestModel):
    type: str | None = None  # None or "custom": a client tool; server tools (web_search_..., bash_...) are refused
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required for client tools (checked when translating)
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls are grammar-checked either way
    input_examples: list[dict[str, Any]] | None = None  # shown to the model with the description
    # Tool search (defer_loading) and programmatic calling (allowed_callers) need Anthropic's server tools, which are
    # refused; without them the tool is just offered and called directly. eager_input_streaming: how input streams.
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    eager_input_streaming: bool | None = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    # Anthropic's own models treat the budget as a target, not a limit; here all output is bounded by max_tokens.
    budget_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    display: str | None = None  # how Anthropic shows its thinking (summarized, omitted); ours is shown as written


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    format: OutputFormat | None = None  # structured output: the answer's text is JSON of this schema (a grammar)
    # How hard Anthropic's models think; a model here has no such control, and answers as it would anyway.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ContextEdit(RequestModel):
    type: str  # clear_thinking_20251015 is served; clear_tool_uses_... (and anything else) is refused
    keep: Any = None  # "all", or {"type": "thinking_turns", "value": N}


class ContextManagement(RequestModel):
    edits: list[ContextEdit] = Field(default_factory=list)


class CountTokensRequest(RequestModel):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None  # Anthropic's context editing (what Claude Code sends)


class MessagesRequest(CountTokensRequest):
    # 0: Anthropic's cache pre-warming; here an empty answer at once (the nodes keep caches only of finished turns).
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL]
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: Annotated[int, Field(ge=0), INTEGRAL] | None = None  # 0: no limit
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # user_id for Anthropic's abuse tracking: nothing to do with the answer


# -- response ------------------------------------------------------------------------------------------------------


class TextBlock(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's encrypted proof of its own thinking; nothing to prove here


class ToolUseBlock(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutputBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class MessageUsage(ResponseModel):
    input_tokens: int  # prompt tokens computed for this request (those read from the nodes' caches not included)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # prompt tokens the nodes still held from the conversation's previous turn


class MessageResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputBlock] = Field(default_factory=list)
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(ResponseModel):
    input_tokens: int


class MessageStreamEvent(ResponseModel):
    """One streamed event (``event: <type>`` then ``data: {"type": <type>, ...}``); ``type`` says which."""

    model_config = ConfigDict(extra="allow")

    type: str


class AnthropicErrorDetail(ResponseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, api_error, ...
    message: str


class AnthropicError(ResponseModel):
    """Anthropic's error body, on every error these paths answer (and as the ``error`` event of a stream)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
