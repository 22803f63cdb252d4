"""Hermes tool-call parser: whole output, streaming in OpenAI's delta shape, malformed blocks."""

from __future__ import annotations

import json
import re

import pytest
from text_splits import splits

from l3worker.structured.tool_parsers import (
    ToolCallStream,
    join_stream_deltas,
    make_tool_call_id,
    parse_tool_calls,
)


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    parsed = parse_tool_calls(text)
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def streamed(pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    parser = ToolCallStream()
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    content, calls = join_stream_deltas(deltas)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
CASES = [
    (f"<tool_call>\n{WEATHER}\n</tool_call>",
     (None, [("get_weather", '{"city": "Paris", "unit": "c"}')])),
    (f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
     '{"name": "now", "arguments": {}}\n</tool_call>',
     ("Let me check.", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("now", "{}")])),
    # arguments holding braces, quotes, escapes and a literal tag inside a string
    ('<tool_call>{"name": "run", "arguments": {"code": "if x: {\\"a\\": [1, \\"}\\"]}", '
     '"n": [1, {"b": null}]}}</tool_call>',
     (None, [("run", '{"code": "if x: {\\"a\\": [1, \\"}\\"]}", "n": [1, {"b": null}]}')])),
    ('<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>', (None, [("search", '{"q": "x"}')])),
    ('<tool_call>{"name": "noargs"}</tool_call>', (None, [("noargs", "{}")])),
    ('<tool_call>{"name": "scalar", "arguments": 12.5}</tool_call>', (None, [("scalar", "12.5")])),
    ('<tool_call>{"name": "s", "arguments": "{\\"a\\": 1}"}</tool_call>', (None, [("s", '"{\\"a\\": 1}"')])),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', (None, [("f", '{"a": 1}')])),  # lost "}"
    ('<tool_call>{"name": "f", "arguments": {"a": "é ✓"}}\n', (None, [("f", '{"a": "é ✓"}')])),  # unclosed
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_', (None, [("f", '{"a": 1}')])),
    # not calls: kept as content verbatim
    ("<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),
    ('<tool_call>{"arguments": {}}</tool_call> tail', ('<tool_call>{"arguments": {}}</tool_call> tail', [])),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', [])),
    ('<tool_call>{"name": "f", "arg', ('<tool_call>{"name": "f", "arg', [])),
    (f"a <tool_call>[1]</tool_call> b <tool_call>{WEATHER}</tool_call> c",
     ("a <tool_call>[1]</tool_call> b  c", [("get_weather", '{"city": "Paris", "unit": "c"}')])),
    ("Just an answer.\n", ("Just an answer.", [])),
    ("mentions <tool_ but no call", ("mentions <tool_ but no call", [])),
    ("", (None, [])),
]


@pytest.mark.parametrize("text,expected", CASES)
def test_parse(text: str, expected: tuple) -> None:
    assert whole(text) == expected


@pytest.mark.parametrize("text,expected", CASES)
def test_stream_joins_to_parse_for_every_split(text: str, expected: tuple) -> None:
    for pieces in splits(text):
        assert streamed(pieces) == expected, pieces


def test_arguments_are_valid_json_and_calls_are_openai_shaped() -> None:
    parsed = parse_tool_calls(CASES[1][0])
    out = [c.to_openai() for c in parsed.tool_calls]
    assert [c["type"] for c in out] == ["function", "function"]
    assert json.loads(out[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert len({c["id"] for c in out}) == 2


def test_tool_call_id_shape() -> None:
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", make_tool_call_id())


def test_stream_delta_shape_first_delta_then_argument_fragments() -> None:
    parser = ToolCallStream()
    deltas = [parser.feed(c) for c in f"Hi <tool_call>\n{WEATHER}\n</tool_call>"]
    deltas.append(parser.finish())
    entries = [e for d in deltas for e in d.tool_calls]
    first = entries[0]
    assert first["index"] == 0 and first["type"] == "function"
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", first["id"])
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    rest = entries[1:]
    assert len(rest) > 5  # fed one char at a time, the arguments stream in many fragments
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in rest)
    assert "".join(e["function"]["arguments"] for e in rest) == '{"city": "Paris", "unit": "c"}'


def test_stream_sends_arguments_before_the_block_closes() -> None:
    parser = ToolCallStream()
    d = parser.feed('<tool_call>{"name": "f", "arguments": {"code": "print(1)')
    assert d.tool_calls[0]["function"] == {"name": "f", "arguments": '{"code": "print(1)'}


def test_second_call_gets_the_next_index() -> None:
    parser = ToolCallStream()
    d = parser.feed(f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>")
    assert [e["index"] for e in d.tool_calls] == [0, 1]


def test_arguments_broken_after_streaming_began_are_sent_as_written() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>'
    assert whole(text) == (text, [])  # the whole-output parser keeps the block as content
    assert streamed([text[:30], text[30:]]) == (None, [("f", '{"a": }')])  # the stream cannot retract
