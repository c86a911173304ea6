"""What a request asks the output to be, as a ``Grammar`` the engine enforces — plain data, callable from any serving
class (chat completions, Responses).

    response_format json_object       -> any JSON object
    response_format json_schema       -> that schema (``strict`` or not: the grammar admits only valid output)
    tool_choice required / a function -> one call (``parallel_tool_calls``: one or more) in the tool-call format
    tool_choice auto / none, text     -> no grammar: the model writes freely (auto: its calls are parsed after)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.api.errors import InvalidRequest
from gateway.generation import Grammar
from gateway.text.tool_parsers import FunctionSpec, ToolFormat, forced_grammar

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools shape the generation: which are offered, and which (if any) must be called."""

    functions: tuple[FunctionSpec, ...]  # offered to the model (empty: tools are off)
    forced: tuple[FunctionSpec, ...]  # one of these must be called (empty: the model may answer in text)
    parallel: bool

    @property
    def active(self) -> bool:
        return bool(self.functions)


def plan_tools(
    functions: Sequence[FunctionSpec],
    choice: Literal["none", "auto", "required"] | str | None,
    parallel: bool,
) -> ToolPlan:
    """``choice``: OpenAI's mode, or the name of the function that must be called."""
    if not functions and choice not in (None, "none", "auto"):
        raise InvalidRequest(
            "tool_choice requires a call, but the request has no tools.", "invalid_value", "tool_choice"
        )
    if not functions or choice == "none":
        return ToolPlan((), (), parallel)
    if choice in (None, "auto"):
        return ToolPlan(tuple(functions), (), parallel)
    if choice == "required":
        return ToolPlan(tuple(functions), tuple(functions), parallel)
    named = tuple(f for f in functions if f.name == choice)
    if not named:
        raise InvalidRequest(
            f"tool_choice names function {choice!r}, which is not in tools.", "invalid_value", "tool_choice"
        )
    return ToolPlan(tuple(functions), named, False)


def schema_grammar(
    kind: Literal["text", "json_object", "json_schema"], schema: dict[str, Any] | None
) -> Grammar | None:
    """The grammar of a ``response_format`` (None: free text)."""
    if kind == "text":
        return None
    if kind == "json_object" or schema is None:
        return Grammar("json_schema", json.dumps(ANY_OBJECT))
    return Grammar("json_schema", json.dumps(schema), param="response_format")


def output_grammar(format_grammar: Grammar | None, tools: ToolPlan, fmt: ToolFormat) -> Grammar | None:
    """The one grammar a generation runs under; a forced tool call and a JSON response format exclude each other."""
    if tools.forced:
        if format_grammar is not None:
            raise InvalidRequest(
                "response_format cannot be combined with a required tool call (tool_choice).",
                "invalid_value",
                "response_format",
            )
        return forced_grammar(fmt, tools.forced, tools.parallel)
    return format_grammar
