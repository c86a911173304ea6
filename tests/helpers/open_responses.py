"""The Open Responses specification's required fields of the response object, checked strictly (unit and end-to-end
tests share it)."""

from __future__ import annotations

from typing import Any

# https://www.openresponses.org/reference (schema ResponseResource, "required"; openresponses/openresponses
# schema/components/schemas/ResponseResource.json). Written out here so that a field dropped from our model fails.
RESPONSE_RESOURCE_REQUIRED = (
    "id",
    "object",
    "created_at",
    "completed_at",
    "status",
    "incomplete_details",
    "model",
    "previous_response_id",
    "instructions",
    "output",
    "error",
    "tools",
    "tool_choice",
    "truncation",
    "parallel_tool_calls",
    "text",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "top_logprobs",
    "temperature",
    "reasoning",
    "user",
    "usage",
    "max_output_tokens",
    "max_tool_calls",
    "store",
    "background",
    "service_tier",
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
)
# Their JSON types where the spec gives one without null ("number" fields are never null).
NUMBERS = ("top_p", "presence_penalty", "frequency_penalty", "temperature")
NON_NULL = {"id": str, "object": str, "created_at": int, "status": str, "model": str, "output": list, "tools": list}
NON_NULL |= {"truncation": str, "parallel_tool_calls": bool, "text": dict, "top_logprobs": int, "store": bool}
NON_NULL |= {"background": bool, "service_tier": str, "metadata": dict}


def check_resource(response: dict[str, Any]) -> None:
    missing = [name for name in RESPONSE_RESOURCE_REQUIRED if name not in response]
    assert not missing, f"required fields missing: {missing}"
    for name, kind in NON_NULL.items():
        assert isinstance(response[name], kind), (name, response[name])
    for name in NUMBERS:
        assert isinstance(response[name], int | float) and not isinstance(response[name], bool), name
    assert response["completed_at"] is None or isinstance(response["completed_at"], int)
    assert response["max_output_tokens"] is None or isinstance(response["max_output_tokens"], int)
    for item in response["output"]:
        check_item(item)
    for tool in response["tools"]:
        if tool["type"] == "function":  # FunctionTool: every one of these present, null allowed but for the first two
            assert {"type", "name", "description", "parameters", "strict"} <= set(tool), tool
    check_text_format(response["text"]["format"])


def check_item(item: dict[str, Any]) -> None:
    """An output item, whole or as a stream event carries it."""
    assert {"id", "type", "status"} <= set(item), item  # every item, per the spec's "Required item fields"
    if item["type"] == "message":  # Message.phase: one of its values, or absent; never null
        assert item.get("phase", "final_answer") in ("commentary", "final_answer"), item


def check_text_format(shown: dict[str, Any]) -> None:
    """TextResponseFormat / JsonObjectResponseFormat / JsonSchemaResponseFormat, as the response object echoes it."""
    if shown["type"] != "json_schema":
        assert shown == {"type": shown["type"]} and shown["type"] in ("text", "json_object"), shown
        return
    assert {"type", "name", "description", "schema", "strict"} <= set(shown), shown
    assert isinstance(shown["name"], str) and isinstance(shown["strict"], bool), shown
    assert shown["description"] is None or isinstance(shown["description"], str), shown
    assert shown["schema"] is None or isinstance(shown["schema"], dict), shown
