"""Tool-call parsers on golden strings: whole outputs, and streams cut at every character."""

from __future__ import annotations

import json

import pytest

from moetier.core import StructuredOutput
from moetier.engine.structured import compile_grammar
from moetier.tools.parsers import (
    CallDelta,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedOutput,
    ToolCall,
    ToolParser,
    call_schema,
    detect_tool_parser,
    value_end,
)

HERMES_TWO = (
    "Let me check.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "note": "a \\"}\\" b"}}\n'
    "</tool_call>"
)
HERMES_TWO_CALLS = [
    ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
    ToolCall("get_time", '{"tz": "Europe/Paris", "note": "a \\"}\\" b"}'),
]
MISTRAL_TWO = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "note": "a \\"}\\" b"}}]'
)

GOLDEN: list[tuple[ToolParser, str, ParsedOutput]] = [
    (HermesParser(), "Just text, no call.", ParsedOutput("Just text, no call.", [])),
    (HermesParser(), HERMES_TWO, ParsedOutput("Let me check.", HERMES_TWO_CALLS)),
    (
        HermesParser(),
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        ParsedOutput(None, [ToolCall("f", "{}")]),
    ),
    # unclosed block at EOS, "parameters" for "arguments", arguments as a JSON string
    (
        HermesParser(),
        '<tool_call>{"name": "f", "parameters": {"a": 1}}',
        ParsedOutput(None, [ToolCall("f", '{"a": 1}')]),
    ),
    (
        HermesParser(),
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        ParsedOutput(None, [ToolCall("f", '{"a": 1}')]),
    ),
    # keys in the other order: arguments re-serialized
    (
        HermesParser(),
        '<tool_call>{"arguments": {"a":1}, "name": "f"}</tool_call>',
        ParsedOutput(None, [ToolCall("f", '{"a": 1}')]),
    ),
    # malformed: everything stays content
    (
        HermesParser(),
        'x<tool_call>{"name": "f", "arguments": {"a": </tool_call>',
        ParsedOutput('x<tool_call>{"name": "f", "arguments": {"a": </tool_call>', []),
    ),
    (
        HermesParser(),
        "<tool_call>not json</tool_call>",
        ParsedOutput("<tool_call>not json</tool_call>", []),
    ),
    (MistralParser(), "Hello", ParsedOutput("Hello", [])),
    (MistralParser(), MISTRAL_TWO, ParsedOutput(None, HERMES_TWO_CALLS)),
    (
        MistralParser(),
        'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": true}}]',
        ParsedOutput("Sure. ", [ToolCall("f", '{"a": true}')]),
    ),
    (
        MistralParser(),
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}',
        ParsedOutput('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}', []),
    ),
    (
        Llama3JsonParser(),
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris", "note": "a \\"}\\" b"}}',
        ParsedOutput(None, HERMES_TWO_CALLS),
    ),
    (
        Llama3JsonParser(),
        '<|python_tag|>{"name": "f", "parameters": {}}',
        ParsedOutput(None, [ToolCall("f", "{}")]),
    ),
    (
        Llama3JsonParser(),
        '\n {"name": "f", "parameters": {"a": [1]}}',
        ParsedOutput(None, [ToolCall("f", '{"a": [1]}')]),
    ),
    # a call only at the start; text then JSON is content
    (
        Llama3JsonParser(),
        'Here: {"name": "f", "parameters": {}}',
        ParsedOutput('Here: {"name": "f", "parameters": {}}', []),
    ),
    (Llama3JsonParser(), '{"a": 1}', ParsedOutput('{"a": 1}', [])),
]


@pytest.mark.parametrize("parser,text,expected", GOLDEN)
def test_parse_golden(parser: ToolParser, text: str, expected: ParsedOutput) -> None:
    assert parser.parse(text) == expected


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[CallDelta]]:
    stream = parser.stream()
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        out = stream.feed(piece, final=i == len(pieces) - 1)
        content += out.content
        deltas += out.calls
    return content, deltas


def _merge(deltas: list[CallDelta]) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for d in deltas:
        if d.name is not None:
            assert d.index == len(calls)  # a call's name comes first, once
            calls.append(ToolCall(d.name, ""))
        calls[d.index].arguments += d.arguments
    return calls


@pytest.mark.parametrize("parser,text,expected", [g for g in GOLDEN if g[2].calls])
def test_stream_by_character_equals_parse(
    parser: ToolParser, text: str, expected: ParsedOutput
) -> None:
    content, deltas = _stream(parser, list(text))
    assert (content or None) == expected.content
    assert _merge(deltas) == expected.calls


def test_hermes_stream_deltas_exact() -> None:
    pieces = [
        "Hi <tool",
        "_call>\n",
        '{"name": "get_w',
        'eather", "argu',
        'ments": {"city": ',
        '"Par',
        'is"}}\n</tool_call>',
    ]
    stream = HermesParser().stream()
    got = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert [g.content for g in got] == ["Hi ", "", "", "", "", "", ""]
    assert [g.calls for g in got] == [
        [],
        [],
        [],
        [],
        [CallDelta(0, "get_weather", '{"city": ')],
        [CallDelta(0, None, '"Par')],
        [CallDelta(0, None, 'is"}')],
    ]


def test_mistral_stream_deltas_exact() -> None:
    pieces = [
        "[TOOL_CALLS][",
        '{"name": "a", "arguments": {"x"',
        ": 1}}, ",
        '{"name": "b", ',
        '"arguments": {}}]',
    ]
    stream = MistralParser().stream()
    got = [stream.feed(p, final=i == len(pieces) - 1).calls for i, p in enumerate(pieces)]
    assert got == [
        [],
        [CallDelta(0, "a", '{"x"')],
        [CallDelta(0, None, ": 1}")],
        [],
        [CallDelta(1, "b", "{}")],
    ]


def test_llama_stream_holds_only_what_may_open_a_call() -> None:
    stream = Llama3JsonParser().stream()
    assert stream.feed("\n").content == ""  # a call may still start
    assert stream.feed("Hi {").content == "\nHi {"
    stream = Llama3JsonParser().stream()
    assert [stream.feed(p).content for p in ["<|py", "thon_tag|>", '{"name": "f", ']] == [
        "",
        "",
        "",
    ]
    assert stream.feed('"parameters": {"x": 1}}').calls == [CallDelta(0, "f", '{"x": 1}')]


def test_text_that_only_looks_like_a_marker_is_released() -> None:
    stream = HermesParser().stream()
    assert stream.feed("a <tool").content == "a "
    assert stream.feed("box>").content == "<toolbox>"
    assert stream.feed(" <to").content == " "
    assert stream.feed("", final=True).content == "<to"
    assert not stream.called


def test_forced_grammars_name_each_tool() -> None:
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g"}},
    ]
    hermes = HermesParser().forced_grammar(tools, lambda _: None)
    assert hermes.startswith('start: "<tool_call>\\n" %json {"anyOf": [')
    assert hermes.endswith('"\\n</tool_call>"')
    assert '"const": "g"' in hermes
    mistral = MistralParser().forced_grammar(tools[:1], lambda t: 5)
    assert mistral.startswith('start: <[5]> "[" %json {"type": "object", "properties": ')
    body = json.loads(mistral.split("%json ", 1)[1].rsplit(' "]"', 1)[0])
    assert body["properties"]["name"] == {"const": "f"}
    llama = json.loads(Llama3JsonParser().forced_grammar(tools[:1], lambda _: None)[13:])
    assert llama["required"] == ["name", "parameters"]
    for parser in (HermesParser(), MistralParser(), Llama3JsonParser()):
        for ids in (lambda _: None, lambda _: 5):
            compile_grammar(StructuredOutput(grammar=parser.forced_grammar(tools, ids)))


def test_forced_grammar_keeps_references_resolvable() -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}},
              "required": ["at"], "$defs": {"Point": point}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": params}} for n in "fg"]
    schema = call_schema(tools)
    assert schema["$defs"] == {"Point": point} and '"$defs":' not in json.dumps(schema["anyOf"])
    compile_grammar(StructuredOutput(grammar=HermesParser().forced_grammar(tools, lambda _: None)))
    clash = {**params, "$defs": {"Point": {"type": "string"}}}
    tools.append({"type": "function", "function": {"name": "h", "parameters": clash}})
    with pytest.raises(ValueError, match="Point"):
        call_schema(tools)


def test_detect_and_value_end() -> None:
    assert isinstance(detect_tool_parser("... <tool_call> ..."), HermesParser)
    assert isinstance(detect_tool_parser("{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(detect_tool_parser("{{- '<|python_tag|>' }}"), Llama3JsonParser)
    assert detect_tool_parser("{{ messages }}") is None
    assert value_end('{"a": "}"} x', 0) == 10
    assert value_end('[1, {"b": [2]}]', 0) == 15
    assert value_end('{"a": [1', 0) is None
    assert value_end("12", 0) is None and value_end("12,", 0) == 2
