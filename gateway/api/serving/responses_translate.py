"""A /v1/responses request as the chat request the chat serving path runs: input items -> messages, instructions ->
a system message, function tools -> chat tools, ``text.format`` -> ``response_format``.

Fields the chat request model does not (yet) know are refused here with ``unsupported_parameter`` instead of being
dropped by its ``extra="ignore"``: a client that sends tools must never silently get plain text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from gateway.api.errors import InvalidRequest, first_complaint
from gateway.api.protocol.chat import ChatCompletionRequest, ChatMessage
from gateway.api.protocol.responses import (
    FunctionCall,
    FunctionTool,
    InputContent,
    InputItem,
    NamedToolChoice,
    ResponsesRequest,
)
from gateway.api.serving.compaction_summary import PREFACE, opened

Message = dict[str, Any]

_TEXT_PARTS = {"input_text", "output_text", "text"}
_MEDIA_PARTS = {"input_image", "input_file", "input_audio", "input_video"}
# ``include`` values that only ask for fields this gateway never has to fill: Codex asks for encrypted reasoning
# (to replay it with store false); reasoning here is plain text in the output, there is nothing to encrypt.
INCLUDE_ACCEPTED = frozenset({"reasoning.encrypted_content", "message.output_text.logprobs"})
LOGPROBS = "message.output_text.logprobs"  # the message text's token logprobs (``top_logprobs`` alternatives each)


@dataclass(frozen=True)
class Translated:
    chat: ChatCompletionRequest
    turn: list[Message]  # this request's input as chat messages (stored for a later previous_response_id)


def unsupported(param: str, what: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"{what or repr(param)} is not supported by this server.", "unsupported_parameter", param)


def check_supported(body: ResponsesRequest, reasons: bool = False) -> None:
    """Known Responses fields this gateway does not implement, where their value would change the answer.

    ``reasons``: the model thinks before answering (a reasoning parser is on). Only there would ``reasoning.effort``
    change the answer; on any other model it is accepted (and echoed), as it changes nothing."""
    refused = {
        "prompt": body.prompt is not None,
        "include": any(value not in INCLUDE_ACCEPTED for value in body.include or []),
        "truncation": body.truncation not in (None, "disabled"),
        "reasoning": reasons and body.reasoning is not None and (body.reasoning.effort or "none") != "none",
    }
    if body.background and body.store is False:
        raise InvalidRequest("background responses must be stored (store: true).", "invalid_value", "store")
    for param, is_refused in refused.items():
        if is_refused:
            raise unsupported(param)
    for tool in functions(body.tools or []):
        if tool.type != "function" or not tool.name:
            raise InvalidRequest(
                f"Tools of type {tool.type!r} are not supported; only named 'function' tools (and namespaces of "
                "them) are.",
                "unsupported_value",
                "tools",
            )


def functions(tools: list[FunctionTool]) -> list[FunctionTool]:
    """The request's function tools, a namespace's as ``namespace.name`` (how the model sees and calls them)."""
    flat: list[FunctionTool] = []
    for tool in tools:
        if tool.type == "namespace" and tool.name:
            flat += [inner.model_copy(update={"name": f"{tool.name}.{inner.name}"}) for inner in tool.tools or []]
        else:
            flat.append(tool)
    return flat


def namespaced(tools: list[FunctionTool]) -> dict[str, tuple[str, str]]:
    """``namespace.name`` -> (namespace, name) for every function inside a namespace tool."""
    return {
        f"{tool.name}.{inner.name}": (tool.name, inner.name or "")
        for tool in tools
        if tool.type == "namespace" and tool.name
        for inner in tool.tools or []
    }


def chat_request(body: ResponsesRequest, history: list[Message], reasons: bool = False) -> Translated:
    """The chat request for ``body`` continuing ``history`` (the stored conversation of previous_response_id)."""
    fields, turn = chat_fields(body, history, reasons)
    _require_fields(ChatCompletionRequest, list(fields), "")
    for message in fields["messages"]:
        if "tool_calls" in message:
            _require_fields(ChatMessage, ["tool_calls"], "input", "function_call items (tool calls)")
        if "tool_call_id" in message:
            _require_fields(ChatMessage, ["tool_call_id"], "input", "function_call_output items (tool results)")
    try:
        chat = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, top = first_complaint(exc, "input")
        param = {"response_format": "text.format", "tools": "tools", "tool_choice": "tool_choice"}.get(top, "input")
        raise InvalidRequest(message, "invalid_value", param) from None
    return Translated(chat, turn)


def chat_fields(
    body: ResponsesRequest, history: list[Message], reasons: bool = False
) -> tuple[dict[str, Any], list[Message]]:
    """The chat request's fields (those set) and this turn's input messages."""
    check_supported(body, reasons)
    turn = input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": system + history + turn,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.seed,
        "stream": body.stream,
        **_logprob_fields(body),
        "user": body.user,
        **_tool_fields(body),
        **_format_fields(body),
    }
    return {key: value for key, value in fields.items() if value is not None}, turn


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the message text carries its tokens' logprobs: only when ``include`` asks (as OpenAI: ``top_logprobs``
    alone returns none)."""
    return LOGPROBS in (body.include or [])


def _logprob_fields(body: ResponsesRequest) -> dict[str, Any]:
    return {"logprobs": True, "top_logprobs": body.top_logprobs or 0} if wants_logprobs(body) else {}


def input_messages(items: str | list[InputItem]) -> list[Message]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[Message] = []
    for item in items:
        if item.type == "message":
            messages.append(_message(item))
        elif item.type == "function_call":
            _add_call(messages, item)
        elif item.type == "compaction":
            messages.append({"role": "user", "content": PREFACE + opened(item.encrypted_content)})
        elif item.type == "function_call_output":
            output = item.output if isinstance(item.output, str) else _text(item.output or [])
            messages.append({"role": "tool", "tool_call_id": _call_id(item), "content": output})
        else:
            raise InvalidRequest(
                f"Input items of type {item.type!r} are not supported; message, function_call, "
                "function_call_output and compaction are.",
                "unsupported_value",
                "input",
            )
    if not messages:
        raise InvalidRequest("The input is empty.", "invalid_value", "input")
    return messages


def assistant_message(text: str, calls: list[FunctionCall]) -> Message:
    """A response's output as the chat message its next turn replays."""
    message: Message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [_tool_call(call.call_id, call.flat_name, call.arguments) for call in calls]
    return message


def _message(item: InputItem) -> Message:
    if item.role is None:
        raise InvalidRequest("A message item needs a role.", "invalid_value", "input")
    role = "system" if item.role == "developer" else item.role
    content = item.content if isinstance(item.content, str) else _text(item.content or [])
    return {"role": role, "content": content}


def _text(parts: list[InputContent]) -> str:
    texts = []
    for part in parts:
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type in _MEDIA_PARTS:
            raise InvalidRequest(
                f"This model reads text only: it cannot take {part.type!r} content. Send the input as input_text.",
                "unsupported_value",
                "input",
            )
        else:
            raise InvalidRequest(
                f"Content parts of type {part.type!r} are not supported; only text is.", "unsupported_value", "input"
            )
    return "\n".join(texts)


def _add_call(messages: list[Message], item: InputItem) -> None:
    """A function call joins the assistant message before it (text, then calls; parallel calls share a message)."""
    if not item.name:
        raise InvalidRequest("A function_call item needs a name.", "invalid_value", "input")
    name = item.name if item.namespace is None else f"{item.namespace}.{item.name}"
    call = _tool_call(_call_id(item), name, item.arguments or "{}")
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_id(item: InputItem) -> str:
    if not item.call_id:
        raise InvalidRequest(f"A {item.type} item needs a call_id.", "invalid_value", "input")
    return item.call_id


def _tool_call(call_id: str, name: str, arguments: str) -> Message:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_fields(body: ResponsesRequest) -> dict[str, Any]:
    choice: Any = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function" or not choice.name:
            raise InvalidRequest("tool_choice must name a function tool.", "unsupported_value", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.name}}
    if not body.tools:  # a choice that requires a call is refused where the chat request is planned
        return {} if choice in (None, "none", "auto") else {"tool_choice": choice}
    tools = [
        {
            "type": "function",
            "function": {
                key: value
                for key, value in (
                    ("name", tool.name),
                    ("description", tool.description),
                    ("parameters", tool.parameters),
                    ("strict", tool.strict),
                )
                if value is not None
            },
        }
        for tool in functions(body.tools)
    ]
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls}


def _format_fields(body: ResponsesRequest) -> dict[str, Any]:
    form = body.text.format if body.text else None
    if form is None or form.type == "text":
        return {}
    if form.type == "json_object":
        return {"response_format": {"type": "json_object"}}
    if form.schema_ is None or not form.name:
        raise InvalidRequest("text.format json_schema needs a name and a schema.", "invalid_value", "text.format")
    schema = {"name": form.name, "schema": form.schema_, "strict": form.strict, "description": form.description}
    return {
        "response_format": {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}
    }


def _require_fields(
    model: type[ChatCompletionRequest | ChatMessage], names: list[str], param: str, what: str = ""
) -> None:
    """Refuse what the chat request model would drop: its fields grow as the chat path learns tools and formats."""
    for name in names:
        if name not in model.model_fields:
            shown = {"tools": "tools", "response_format": "text.format"}.get(name, name)
            raise unsupported(param or shown, what or None)
