"""A chat request's messages and tools as the model's chat template takes them.

A template that knows tools (its source uses ``tools``: Qwen, Llama 3.1, Mistral, Hermes) gets OpenAI's shapes as
Hugging Face templates expect them: ``tools=``, assistant ``tool_calls`` with their arguments as objects, and
``role: tool`` messages with ``tool_call_id``. A template that does not (SmolLM2's) gets our documented default
instead, all in plain messages it can render:

* the tools described in a system message (``default_tools_prompt``: Hermes's ``<tool_call>{json}</tool_call>``);
* an assistant's earlier calls written into its content in that same format;
* a tool's result as a user message ``<tool_response>...</tool_response>`` (many templates insist on alternating
  user/assistant turns, and know no ``tool`` role).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.api.errors import InvalidRequest
from gateway.api.protocol.chat import ChatMessage, ToolCallIn
from gateway.text.tool_parsers import FunctionSpec, default_tools_prompt

# chat_template_kwargs that would change how the prompt is rendered rather than what the template shows.
_RESERVED_KWARGS = frozenset({"messages", "tools", "tokenize", "add_generation_prompt", "chat_template", "return_dict"})


def template_has_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    for key in kwargs or {}:
        if key in _RESERVED_KWARGS:
            raise InvalidRequest(f"chat_template_kwargs may not set {key!r}.", "invalid_value", "chat_template_kwargs")
    return dict(kwargs or {})


def template_messages(
    messages: Sequence[ChatMessage], functions: Sequence[FunctionSpec], native_tools: bool
) -> list[dict[str, Any]]:
    """The messages to render; with ``functions`` offered and no ``native_tools``, our tools prompt comes first."""
    rendered = [_message(m, native_tools) for m in messages]
    if functions and not native_tools:
        prompt = default_tools_prompt(functions)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def template_tools(functions: Sequence[FunctionSpec]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": f.name, "description": f.description or "", "parameters": f.parameters},
        }
        for f in functions
    ]


def _message(message: ChatMessage, native_tools: bool) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for system
    content = _text(message)
    if role == "tool" and not native_tools:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if message.tool_calls and not native_tools:
        written = "".join(_written_call(call) for call in message.tool_calls)
        return {"role": role, "content": f"{content}\n{written}" if content else written}
    result: dict[str, Any] = {"role": role, "content": content}
    if message.name:
        result["name"] = message.name
    if message.tool_calls:
        result["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


def _text(message: ChatMessage) -> str:
    """Plain-text content (text parts joined); other part types are not supported."""
    content = message.content
    if not isinstance(content, list):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"Content parts of type {part.type!r} are not supported; only text is.", "unsupported_value", "messages"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(call: ToolCallIn) -> Any:
    """Templates write arguments with ``tojson``: an object, not the JSON text OpenAI sends (kept if not JSON)."""
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


def _template_call(call: ToolCallIn) -> dict[str, Any]:
    function = {"name": call.function.name, "arguments": _arguments(call)}
    return {"id": call.id, "type": "function", "function": function}


def _written_call(call: ToolCallIn) -> str:
    body = json.dumps({"name": call.function.name, "arguments": _arguments(call)}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"
