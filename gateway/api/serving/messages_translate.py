"""A /v1/messages request as the chat request the chat serving path runs (so tools, the tool grammar, the template and
the reasoning parser behave as on /v1/chat/completions):

    system (a string or text blocks)       -> a system message
    user text blocks                       -> a user message
    user tool_result blocks                -> tool messages (``tool_call_id``), before the user's text
    assistant text / tool_use / thinking   -> an assistant message: content, tool_calls, reasoning_content
    a last assistant message               -> the prefill: the answer continues its text
    tools (input_schema), tool_choice      -> function tools; auto / any / tool / none -> auto / required / named / none
    stop_sequences, temperature, top_p/k   -> stop, temperature, top_p, top_k
    output_config.format (a JSON schema)   -> response_format json_schema (the same grammar)
    thinking enabled / disabled            -> the chat template's ``enable_thinking``

What the chat path cannot serve is refused here, naming the field: image and document blocks (a text model),
server tools, and any field a client sends that this gateway does not know — except those that cannot change the
answer (``cache_control``, ``metadata``, ``citations``, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway.api.errors import InvalidRequest, first_complaint
from gateway.api.protocol.chat import ChatCompletionRequest
from gateway.api.protocol.common import UnsupportedParameter
from gateway.api.protocol.messages import ContentBlock, CountTokensRequest, InputMessage, MessagesRequest, Tool

Message = dict[str, Any]

# Top-level fields accepted and ignored: none changes what is generated.
IGNORED_FIELDS = frozenset(
    {
        "metadata",  # user_id, for Anthropic's abuse tracking
        "service_tier",  # Anthropic's capacity tier
        "inference_geo",  # where Anthropic runs the request
        "speed",  # Anthropic's latency tier
        "cache_control",  # a prompt-caching breakpoint: the nodes keep a conversation's cache by themselves
        "diagnostics",  # asks Anthropic why its prompt cache missed (the response's diagnostics stay null)
        "user_profile_id",  # Anthropic's account bookkeeping
        "workspace_id",
    }
)
_IGNORED_BLOCK_FIELDS = frozenset({"cache_control", "citations", "caller", "toolset_name"})
_SERVED_BLOCKS = "text, tool_use, tool_result, thinking and redacted_thinking"


@dataclass(frozen=True)
class Translated:
    chat: ChatCompletionRequest
    prefill: str  # the text of a last assistant message: the answer continues it ("" when the user spoke last)


def invalid(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, "invalid_value", param)


def chat_request(body: CountTokensRequest) -> Translated:
    """The chat request for ``body`` (a count_tokens body has no sampling fields: they are left out)."""
    _reject_extra(body, "", IGNORED_FIELDS)
    messages, prefill = conversation(body)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, **_tool_fields(body)}
    if isinstance(body, MessagesRequest):
        fields |= {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
        fields["stop"] = body.stop_sequences or None
    if body.output_config is not None:
        _reject_extra(body.output_config, "output_config", frozenset())
        if body.output_config.format is not None:
            schema = {"name": "output", "schema": body.output_config.format.schema_}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if body.thinking is not None and body.thinking.type != "adaptive":
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    fields = {key: value for key, value in fields.items() if value is not None}
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise invalid(*first_complaint(exc, "messages")) from None
    if prefill and fields.get("tool_choice") not in (None, "auto", "none"):
        raise invalid("A final assistant message (prefill) cannot be combined with a required tool call.", "messages")
    return Translated(chat, prefill)


def conversation(body: CountTokensRequest) -> tuple[list[Message], str]:
    """The chat messages (system first) and the prefill."""
    system = _system(body.system)
    messages: list[Message] = [{"role": "system", "content": system}] if system is not None else []
    turns = list(body.messages)
    prefill = ""
    if turns[-1].role == "assistant":
        prefill = _prefill(turns.pop(), len(turns), "a final assistant message (the prefill) takes text blocks only")
    for index, turn in enumerate(turns):
        if turn.role == "system":
            messages.append({"role": "system", "content": _prefill(turn, index, "system messages take text blocks")})
        else:
            messages += _user(turn, index) if turn.role == "user" else [_assistant(turn, index)]
    if not any(message["role"] != "system" for message in messages):
        raise invalid("The conversation needs a user message before the assistant's.", "messages")
    _clear_thinking(messages, _thinking_turns_kept(body))
    return messages, prefill


def _thinking_turns_kept(body: CountTokensRequest) -> int | None:
    """How many recent assistant turns keep their thinking (None: all), from ``context_management``'s edits."""
    kept: int | None = None
    for index, edit in enumerate(body.context_management.edits if body.context_management else []):
        where = f"context_management.edits[{index}]"
        _reject_extra(edit, where, frozenset())
        if edit.type != "clear_thinking_20251015":
            raise InvalidRequest(
                f"Context edits of type {edit.type!r} are not supported; clear_thinking_20251015 is.",
                "unsupported_value",
                f"{where}.type",
            )
        keep = edit.keep
        if isinstance(keep, dict) and keep.get("type") == "thinking_turns" and isinstance(keep.get("value"), int):
            kept = keep["value"]
        elif keep not in (None, "all"):
            raise invalid("keep must be 'all' or {'type': 'thinking_turns', 'value': N}.", f"{where}.keep")
    return kept


def _clear_thinking(messages: list[Message], kept: int | None) -> None:
    """Drop the thinking of all but the last ``kept`` assistant turns (Anthropic's clear_thinking edit)."""
    if kept is None:
        return
    thinking = [message for message in messages if "reasoning_content" in message]
    for message in thinking[: max(0, len(thinking) - kept)]:
        del message["reasoning_content"]


def _system(system: str | list[ContentBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    texts = []
    for index, block in enumerate(system):
        texts.append(_text(block, f"system[{index}]", "system blocks are text"))
    return "\n".join(texts)


def _blocks(turn: InputMessage) -> list[ContentBlock]:
    if isinstance(turn.content, str):
        return [ContentBlock(type="text", text=turn.content)]
    return turn.content


def _user(turn: InputMessage, index: int) -> list[Message]:
    """Tool results as tool messages, then the user's text (Anthropic puts results first in the turn)."""
    results: list[Message] = []
    texts: list[str] = []
    for at, block in enumerate(_blocks(turn)):
        where = f"messages[{index}].content[{at}]"
        _check(block, where, ("text", "tool_result"), "a user turn takes text and tool_result blocks")
        if block.type == "text":
            texts.append(_text(block, where, ""))
        else:
            results.append(_tool_result(block, where))
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _tool_result(block: ContentBlock, where: str) -> Message:
    if not block.tool_use_id:
        raise invalid("A tool_result block needs its tool_use_id.", f"{where}.tool_use_id")
    content = block.content
    if isinstance(content, list):
        parts = []
        for at, part in enumerate(content):
            parts.append(_text(part, f"{where}.content[{at}]", "a tool result holds text"))
        content = "\n".join(parts)
    text = content or ""
    # The model reads whether the tool failed: the result says so, as Anthropic's own models are shown it.
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": f"Error: {text}" if block.is_error else text}


def _assistant(turn: InputMessage, index: int) -> Message:
    texts, calls, thoughts = [], [], []
    for at, block in enumerate(_blocks(turn)):
        where = f"messages[{index}].content[{at}]"
        kinds = ("text", "tool_use", "thinking", "redacted_thinking")
        _check(block, where, kinds, "an assistant turn takes text, tool_use and thinking blocks")
        if block.type == "text":
            texts.append(_text(block, where, ""))
        elif block.type == "tool_use":
            calls.append(_tool_call(block, where))
        elif block.type == "thinking":
            thoughts.append(block.thinking or "")
        # redacted_thinking: Anthropic's encrypted thinking, no text any model could read
    message: Message = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _tool_call(block: ContentBlock, where: str) -> Message:
    if not block.id or not block.name:
        raise invalid("A tool_use block needs its id and name.", where)
    if not isinstance(block.input, dict):
        raise invalid("A tool_use block's input must be an object.", f"{where}.input")
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def _prefill(turn: InputMessage, index: int, rule: str) -> str:
    """A turn that holds text only (the prefill, a system message) as that text."""
    return "".join(_text(block, f"messages[{index}].content[{at}]", rule) for at, block in enumerate(_blocks(turn)))


def _tool_fields(body: CountTokensRequest) -> dict[str, Any]:
    choice = body.tool_choice
    fields: dict[str, Any] = {}
    if body.tools:
        fields["tools"] = [_function(tool, index) for index, tool in enumerate(body.tools)]
    if choice is not None:
        _reject_extra(choice, "tool_choice", frozenset())
        if choice.type == "tool" and not choice.name:
            raise invalid("tool_choice of type 'tool' needs the tool's name.", "tool_choice.name")
        named = {"type": "function", "function": {"name": choice.name}}
        modes = {"auto": "auto", "any": "required", "none": "none", "tool": named}
        if body.tools or choice.type in ("any", "tool"):  # a required call without tools is refused when planned
            fields["tool_choice"] = modes[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def _function(tool: Tool, index: int) -> Message:
    where = f"tools[{index}]"
    _reject_extra(tool, where, frozenset())
    if tool.type not in (None, "custom"):
        raise InvalidRequest(
            f"Tools of type {tool.type!r} (Anthropic's server tools) are not supported; only client tools with an "
            "input_schema are.",
            "unsupported_value",
            f"{where}.type",
        )
    if tool.input_schema is None:
        raise InvalidRequest("A tool needs its input_schema.", "missing_required_parameter", f"{where}.input_schema")
    function = {"name": tool.name, "parameters": tool.input_schema}
    description = tool.description or ""
    if tool.input_examples:  # Anthropic shows them to its models beside the description
        shown = "\n".join(json.dumps(example, ensure_ascii=False) for example in tool.input_examples)
        description = f"{description}\n\nExamples of input:\n{shown}".strip()
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def _text(block: ContentBlock, where: str, rule: str) -> str:
    _check(block, where, ("text",), rule)
    if block.text is None:
        raise InvalidRequest("A text block needs its text.", "missing_required_parameter", f"{where}.text")
    return block.text


def _check(block: ContentBlock, where: str, kinds: tuple[str, ...], rule: str) -> None:
    """The block's type first (an image's ``source`` is no unknown field: images are refused as such)."""
    if block.type not in kinds:
        raise _unserved(block, where, rule)
    _reject_extra(block, where, _IGNORED_BLOCK_FIELDS)


def _unserved(block: ContentBlock, where: str, rule: str) -> InvalidRequest:
    if block.type in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
        return invalid(f"A {block.type!r} block is not allowed here: {rule}.", f"{where}.type")
    return InvalidRequest(
        f"Content blocks of type {block.type!r} are not supported by this text model; {_SERVED_BLOCKS} are.",
        "unsupported_value",
        f"{where}.type",
    )


def _reject_extra(model: BaseModel, where: str, ignored: frozenset[str]) -> None:
    for name in model.model_extra or {}:
        if name not in ignored:
            raise UnsupportedParameter(f"{where}.{name}" if where else name)
