"""Ollama's requests as our chat requests: model names, messages, tools, ``format``, ``think`` and ``options``.

An option is mapped onto our sampling, accepted because it cannot change the answer (how Ollama runs: threads, GPU
layers, mmap), accepted at its neutral value (``typical_p`` 1, ``mirostat`` 0, ...), or refused with a 400 naming it:
nothing that would change the answer is dropped silently.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.api.errors import InvalidRequest, NotFound
from gateway.api.protocol.chat import ChatCompletionRequest
from gateway.api.protocol.ollama import ChatRequest, GenerationFields, Message, Options

LATEST = ":latest"

# How Ollama runs a model, not what it answers.
RUNTIME_OPTIONS = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "num_thread",
        "embedding_only",
        "logits_all",
        "num_keep",  # which tokens survive a context shift: we never shift (a prompt that does not fit is a 400)
        "penalize_newline",  # ignored by Ollama itself since its new engine
    }
)
# Options accepted at the value that leaves sampling as it is.
NEUTRAL_OPTIONS: dict[str, object] = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
MIROSTAT_ONLY = frozenset({"mirostat_tau", "mirostat_eta"})  # no effect while mirostat is off
# Top-level fields that cannot change the answer.
IGNORED_FIELDS = frozenset({"keep_alive", "stream"})


def model_tag(name: str) -> str:
    """How Ollama clients name a model: ``name:tag``, ours always ``:latest``."""
    return name if ":" in name else name + LATEST


def untagged(name: str) -> str:
    """``model:latest`` -> ``model``; ``model`` stays; any other tag is no model of ours (kept, so it is a 404)."""
    return name.removesuffix(LATEST)


def ollama_not_found(model: str) -> NotFound:
    shown = model if len(model) <= 200 else model[:200] + "…"
    return NotFound(f"model '{shown}' not found", "model_not_found", "model")


def check_options(options: Options | None, context_length: int) -> None:
    """Refuse what we would have to drop; ``num_ctx`` beyond the window this swarm can hold."""
    if options is None:
        return
    if options.num_ctx is not None and options.num_ctx > context_length:
        raise InvalidRequest(
            f"num_ctx {options.num_ctx} is more than this model's context length here ({context_length} tokens)",
            "invalid_value",
            "options.num_ctx",
        )
    extra = options.model_extra or {}
    for name, value in extra.items():
        if name in RUNTIME_OPTIONS or (name in MIROSTAT_ONLY and not extra.get("mirostat")):
            continue
        if name in NEUTRAL_OPTIONS and value == NEUTRAL_OPTIONS[name]:
            continue
        if name == "repeat_last_n" and (value == -1 or not _penalized(options)):
            continue  # -1: the whole context, which is the window our penalties use
        raise InvalidRequest(f"option '{name}' is not supported by this server", "unsupported_parameter", name)


def _penalized(options: Options) -> bool:
    return options.repeat_penalty not in (None, 1.0) or bool(options.presence_penalty or options.frequency_penalty)


def check_fields(body: GenerationFields, unsupported: tuple[str, ...]) -> None:
    """Unknown top-level fields are ignored (Ollama's decoder does so); ``unsupported`` ones set are a 400."""
    for name in unsupported:
        if getattr(body, name, None):
            raise InvalidRequest(f"'{name}' is not supported by this server", "unsupported_parameter", name)


def sampling_fields(options: Options | None, fmt: Any) -> dict[str, Any]:
    """The chat request's sampling and length fields for Ollama's ``options`` and ``format``."""
    fields: dict[str, Any] = {}
    if options is not None:
        for ours, theirs in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("min_p", "min_p"),
            ("seed", "seed"),
            ("presence_penalty", "presence_penalty"),
            ("frequency_penalty", "frequency_penalty"),
            ("repetition_penalty", "repeat_penalty"),
        ):
            if (value := getattr(options, theirs)) is not None:
                fields[ours] = value
        if options.top_k is not None:
            fields["top_k"] = max(0, options.top_k)
        if options.num_predict is not None and options.num_predict > 0:
            fields["max_tokens"] = options.num_predict  # -1 and -2: until the end or the context is full
        if options.stop:
            fields["stop"] = [options.stop] if isinstance(options.stop, str) else options.stop
    if fmt == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    return fields


def chat_request(body: ChatRequest, model: str, thinking: bool | None) -> ChatCompletionRequest:
    """``model``: our own name for the one the client sent; ``thinking``: the template's enable_thinking (None:
    left to the template)."""
    data: dict[str, Any] = {
        "model": model,
        "messages": [_message(m) for m in body.messages],
        **sampling_fields(body.options, body.format),
    }
    if body.tools:
        data["tools"] = [_tool(tool) for tool in body.tools]
    if thinking is not None:
        data["chat_template_kwargs"] = {"enable_thinking": thinking}
    try:
        return ChatCompletionRequest.model_validate(data, strict=False)
    except ValueError as exc:
        raise InvalidRequest(f"invalid request: {exc}", "invalid_value") from None


def _message(message: Message) -> dict[str, Any]:
    if message.images:
        raise InvalidRequest("this model does not support images", "invalid_value", "images")
    result: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.thinking:
        result["reasoning_content"] = message.thinking
    if message.tool_calls:
        result["tool_calls"] = [
            {
                "id": call.id or f"call_{index}",
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.dumps(call.function.arguments)},
            }
            for index, call in enumerate(message.tool_calls)
        ]
    if message.role == "tool" and message.tool_name:
        result["name"] = message.tool_name
    return result


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """Ollama's tool is OpenAI's (``type`` may be left out)."""
    return {"type": tool.get("type", "function"), "function": tool.get("function", {})}
