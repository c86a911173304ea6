"""Tool-call parsers per format, reasoning tags, and the forced-call grammars: streamed pieces (any split) add up to
the output parsed whole."""

from __future__ import annotations

import json

import pytest

from gateway.api.serving.structured import plan_tools, schema_grammar
from gateway.text.chat_output import ChatOutputParser
from gateway.text.reasoning import ReasoningParser, reasoning_enabled, starts_inside
from gateway.text.tool_parsers import FORMATS, FunctionSpec, ParsedText, ToolCallParser, choose_format, forced_grammar


def parse(fmt: str, text: str, step: int) -> tuple[str, list[tuple[str, str]], list[ParsedText]]:
    parser = ToolCallParser(FORMATS[fmt])  # type: ignore[index]
    pieces = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    calls = [(call.name, call.arguments) for call in parser.calls]
    return "".join(p.content for p in pieces), calls, pieces


def streamed_calls(pieces: list[ParsedText]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        for delta in piece.calls:
            if delta.id is not None:
                assert delta.index not in calls and delta.name  # id and name come first, once
                calls[delta.index] = [delta.name, ""]
            calls[delta.index][1] += delta.arguments
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


CASES = [
    (
        "hermes",
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "Let me check. ",
        [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("get_time", "{}")],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"q": "a\\"b"}, "name": "search"}\n</tool_call>',  # arguments before the name
        "",
        [("search", '{"q": "a\\"b"}')],
    ),
    ("hermes", "No call here, only <tool but text.", "No call here, only <tool but text.", []),
    (
        "llama3_json",
        ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": [true, null]}}',
        "",
        [("f", '{"a": 1}'), ("g", '{"b": [true, null]}')],
    ),
    ("llama3_json", "Plain answer {not a call}", "Plain answer {not a call}", []),
    ("llama3_json", '{"answer": 42} is JSON, no call', '{"answer": 42} is JSON, no call', []),
    ("hermes", '<tool_call>{"oops": 1}</tool_call> after', '{"oops": 1}</tool_call> after', []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {"x": "y"}}, {"name": "g", "arguments": {"z": 2}}]',
        "",
        [("f", '{"x": "y"}'), ("g", '{"z": 2}')],
    ),
    ("mistral", '[{"name": "f", "arguments": {"x": 1}}]', "", [("f", '{"x": 1}')]),  # the special token stripped
    ("mistral", '[{"name": "f"}]', "", [("f", "{}")]),  # no arguments: an empty object
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 10_000])
def test_parsers_split_content_and_calls_the_same_way_for_any_stream_split(
    fmt: str, text: str, content: str, calls: list[tuple[str, str]], step: int
) -> None:
    got_content, got_calls, pieces = parse(fmt, text, step)
    assert got_content == content
    assert got_calls == calls
    assert streamed_calls(pieces) == calls
    for _, arguments in got_calls:
        json.loads(arguments)


def test_call_ids_are_unique_and_shared_by_stream_and_record() -> None:
    parser = ToolCallParser(FORMATS["hermes"])
    deltas = parser.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>')
    ids = [d.id for d in deltas.calls if d.id]
    assert ids == [call.id for call in parser.calls] and len(set(ids)) == 2


def test_an_unfinished_call_keeps_what_it_streamed() -> None:
    parser = ToolCallParser(FORMATS["hermes"])
    first = parser.feed('hi <tool_call>{"name": "f", "arguments": {"a": ')
    assert first.content == "hi " and first.calls[0].name == "f"
    last = parser.finish()
    assert last.content == ""
    streamed = "".join(delta.arguments for delta in first.calls + last.calls)
    # A whole response (the same parser over the whole text) keeps the cut-short call too, as OpenAI does on length.
    assert [(call.name, call.arguments) for call in parser.calls] == [("f", streamed)] and streamed == '{"a": '


def test_the_format_follows_the_template_unless_configured() -> None:
    assert choose_format("{{ '[TOOL_CALLS]' }}", None).name == "mistral"
    assert choose_format("{{ '<|python_tag|>' }}", None).name == "llama3_json"
    assert choose_format("<tool_call> {{ tools }}", None).name == "hermes"
    assert choose_format(None, None).name == "hermes"
    assert choose_format("[TOOL_CALLS]", "hermes").name == "hermes"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_forced_grammars_name_every_function_and_its_schema(fmt: str) -> None:
    functions = [FunctionSpec("f", {"type": "object", "properties": {"x": {"type": "integer"}}}), FunctionSpec("g", {})]
    grammar = forced_grammar(FORMATS[fmt], functions, parallel=True)  # type: ignore[index]
    assert grammar.kind == "lark" and grammar.param == "tools"
    assert '\\"f\\"' in grammar.source and '\\"g\\"' in grammar.source
    assert '"whitespace_flexible": false' in grammar.source


def test_tool_choice_plans() -> None:
    f, g = FunctionSpec("f", {}), FunctionSpec("g", {})
    assert not plan_tools([f, g], "none", True).active
    assert plan_tools([f, g], "auto", True).forced == ()
    assert plan_tools([f, g], "required", True).forced == (f, g)
    named = plan_tools([f, g], "g", True)
    assert named.forced == (g,) and not named.parallel
    with pytest.raises(Exception, match="not in tools"):
        plan_tools([f], "h", True)
    assert schema_grammar("text", None) is None
    grammar = schema_grammar("json_object", None)
    assert grammar is not None and json.loads(grammar.source) == {"type": "object"}


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_reasoning_tags_split_from_content(step: int) -> None:
    for inside, text, reasoning, content in [
        (False, "<think>\nweigh a < b</think>\n\nThe answer.", "\nweigh a < b", "The answer."),
        (True, "first </thin k> then</think> done", "first </thin k> then", "done"),
        (False, "  no thinking <think>", "", "  no thinking <think>"),
        (True, "cut off mid-thought", "cut off mid-thought", ""),
    ]:
        parser = ReasoningParser(inside)
        got = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)] + [parser.finish()]
        assert "".join(r for r, _ in got) == reasoning
        assert "".join(c for _, c in got) == content


def test_reasoning_detection() -> None:
    assert reasoning_enabled("auto", "{% if '</think>' in content %}")
    assert not reasoning_enabled("auto", "{{ messages }}")
    assert not reasoning_enabled("none", "</think>")
    assert reasoning_enabled("qwen3", None)
    assert starts_inside("<|im_start|>assistant\n<think>\n")
    assert not starts_inside("<|im_start|>assistant\n")


def test_reasoning_then_a_tool_call() -> None:
    parser = ChatOutputParser.build(reasoning=True, reasoning_inside=False, tool_format=FORMATS["hermes"])
    text = '<think>need weather</think>Checking. <tool_call>{"name": "w", "arguments": {"c": "P"}}</tool_call>'
    out = [parser.feed(text[i : i + 4]) for i in range(0, len(text), 4)] + [parser.finish()]
    assert "".join(o.reasoning for o in out) == "need weather"
    assert "".join(o.content for o in out) == "Checking. "
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [("w", '{"c": "P"}')]
