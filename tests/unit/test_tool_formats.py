"""DeepSeek-V3/V3.1, gpt-oss harmony and pythonic tool calls on golden strings: whole outputs,
malformed ones (content, never a crash), streams cut at every character, exact stream deltas,
forced grammars that write exactly what the parsers read, and how families pick them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moetier.core import StructuredOutput
from moetier.engine.structured import GrammarMasks, compile_grammar
from moetier.tools.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from moetier.tools.harmony import HarmonyParser
from moetier.tools.parsers import (
    CallDelta,
    HermesParser,
    Llama3JsonParser,
    ParsedOutput,
    ToolCall,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
    tool_parsers,
)
from moetier.tools.pythonic import PythonicParser
from moetier.tools.support import ToolSupport, template_messages
from tests.server.tiny import EOS, VOCAB, save_byte_tokenizer
from tests.unit.test_tool_parsers import HERMES_TWO_CALLS, _merge, _stream

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _ds(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


DS_TWO = (
    "Let me check."
    + B
    + _ds("get_weather", '{"city": "Paris", "days": [1, 2]}')
    + "\n"
    + _ds("get_time", '{"tz": "Europe/Paris", "note": "a \\"}\\" b"}')
    + E
)
H_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
    'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
H_TWO = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
    '"Paris", "days": [1, 2]}<|call|><|start|>assistant<|channel|>analysis<|message|>And the '
    "time.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
    '{"tz": "Europe/Paris", "note": "a \\"}\\" b"}'
)
PY_TWO = '[get_weather(city="Paris", days=[1, 2]), get_time(tz="Europe/Paris", note="a \\"}\\" b")]'
WEATHER = ToolCall("get_weather", '{"city": "Paris"}')

GOLDEN: list[tuple[ToolParser, str, ParsedOutput]] = [
    (DeepSeekV3Parser(), DS_TWO, ParsedOutput("Let me check.", HERMES_TWO_CALLS)),
    (DeepSeekV3Parser(), "No call.", ParsedOutput("No call.", [])),
    # cut at EOS: no closing markers after the last call
    (
        DeepSeekV3Parser(),
        B + f'{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}',
        ParsedOutput(None, [WEATHER]),
    ),
    # V3.1's layout, read by both
    (
        DeepSeekV3Parser(),
        f'{B}{CB}get_weather{SEP}{{"city": "Paris"}}{CE}{E}',
        ParsedOutput(None, [WEATHER]),
    ),
    (
        DeepSeekV31Parser(),
        f'Hi{B}{CB}get_weather{SEP}{{"city": "Paris"}}{CE}{CB}f{SEP}{{}}{CE}{E}',
        ParsedOutput("Hi", [WEATHER, ToolCall("f", "{}")]),
    ),
    # malformed: everything stays content
    (
        DeepSeekV3Parser(),
        f'{B}{CB}function{SEP}get_weather\n{{"city": "Paris"}}{CE}{E}',
        ParsedOutput(f'{B}{CB}function{SEP}get_weather\n{{"city": "Paris"}}{CE}{E}', []),
    ),
    (
        DeepSeekV3Parser(),
        B + _ds("f", '{"a": }'),
        ParsedOutput(B + _ds("f", '{"a": }'), []),
    ),
    (DeepSeekV3Parser(), f"x{B}{E}", ParsedOutput(f"x{B}{E}", [])),
    (DeepSeekV3Parser(), f"{B}oops", ParsedOutput(f"{B}oops", [])),
    (
        DeepSeekV3Parser(),
        B + _ds("f", "[1]") + E,
        ParsedOutput(B + _ds("f", "[1]") + E, []),
    ),
    (HarmonyParser(), H_CALL, ParsedOutput(None, [WEATHER], "Need the weather.")),
    (HarmonyParser(), H_TWO, ParsedOutput(None, HERMES_TWO_CALLS, "And the time.")),
    (
        HarmonyParser(),
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello <|there!",
        ParsedOutput("Hello <|there!", [], "Think."),
    ),
    (
        HarmonyParser(),
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
        "commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
        ParsedOutput("Checking.", [ToolCall("f", "{}")]),
    ),
    (HarmonyParser(), "Plain text, no channels.", ParsedOutput("Plain text, no channels.", [])),
    (
        HarmonyParser(),
        "<|channel|>analysis<|message|>Only thinking",
        ParsedOutput(None, [], "Only thinking"),
    ),
    # malformed calls: the raw text
    (
        HarmonyParser(),
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": <|call|>',
        ParsedOutput(
            '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": <|call|>', []
        ),
    ),
    (
        HarmonyParser(),
        "<|channel|>commentary to=functions.f<|message|>print(1)<|call|>",
        ParsedOutput("<|channel|>commentary to=functions.f<|message|>print(1)<|call|>", []),
    ),
    (
        HarmonyParser(),
        "<|channel|>commentary to=functions.f",
        ParsedOutput("<|channel|>commentary to=functions.f", []),
    ),
    (PythonicParser(), PY_TWO, ParsedOutput(None, HERMES_TWO_CALLS)),
    (
        PythonicParser(),
        "<|python_start|>[f(), g(x=None, y=True, z={'k': (1, 2)})]<|python_end|>",
        ParsedOutput(
            None, [ToolCall("f", "{}"), ToolCall("g", '{"x": null, "y": true, "z": {"k": [1, 2]}}')]
        ),
    ),
    (PythonicParser(), " [a.b(s='it''s')]", ParsedOutput(None, [ToolCall("a.b", '{"s": "its"}')])),
    (PythonicParser(), "[1, 2] is a list", ParsedOutput("[1, 2] is a list", [])),
    (PythonicParser(), "Here: [f(a=1)]", ParsedOutput("Here: [f(a=1)]", [])),
    (PythonicParser(), "[f(a=1)] and more", ParsedOutput("[f(a=1)] and more", [])),
    (PythonicParser(), "[f(1)]", ParsedOutput("[f(1)]", [])),
    (PythonicParser(), "[f(a=g())]", ParsedOutput("[f(a=g())]", [])),
    (PythonicParser(), "[f(a=1), g(b=", ParsedOutput("[f(a=1), g(b=", [])),
]


@pytest.mark.parametrize("parser,text,expected", GOLDEN)
def test_parse_golden(parser: ToolParser, text: str, expected: ParsedOutput) -> None:
    assert parser.parse(text) == expected


@pytest.mark.parametrize(
    "parser,text,expected",
    [g for g in GOLDEN if g[2].calls or g[0].locate(g[1]) is None],
)
def test_stream_by_character_equals_parse(
    parser: ToolParser, text: str, expected: ParsedOutput
) -> None:
    content, deltas = _stream(parser, list(text))
    assert (content or None) == expected.content
    assert _merge(deltas) == expected.calls
    stream = parser.stream()
    reasoning = "".join(stream.feed(c, i == len(text) - 1).reasoning for i, c in enumerate(text))
    assert (reasoning or None) == expected.reasoning
    # and in two pieces cut anywhere
    for cut in range(0, len(text), 7):
        content, deltas = _stream(parser, [text[:cut], text[cut:]])
        assert (content or None, _merge(deltas)) == (expected.content, expected.calls)


def _feed(parser: ToolParser, pieces: list[str]) -> list[tuple[str, list[CallDelta]]]:
    stream = parser.stream()
    outs = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return [(o.content, o.calls) for o in outs]


def test_deepseek_stream_deltas_exact() -> None:
    pieces = ["Hi", B[:5], B[5:] + CB + "function", SEP + "get_w", "eather\n``", "`json\n",
              '{"city": ', '"Paris"}', "\n```" + CE + E]  # fmt: skip
    assert _feed(DeepSeekV3Parser(), pieces) == [
        ("Hi", []),
        ("", []),
        ("", []),
        ("", []),
        ("", [CallDelta(0, "get_weather", "")]),  # the name line is done
        ("", []),
        ("", [CallDelta(0, None, '{"city": ')]),
        ("", [CallDelta(0, None, '"Paris"}')]),
        ("", []),
    ]


def test_harmony_stream_deltas_exact() -> None:
    pieces = ["<|channel|>analysis<|message|>Hmm", ".<|end|><|start|>assistant<|channel|>",
              "commentary<|message|>One mo", "ment<|e", "nd|><|start|>assistant<|channel|>",
              "commentary to=functions.get_", "weather <|constrain|>json<|message|>",
              '{"city": "Par', 'is"}<|ca', "ll|>"]  # fmt: skip
    assert _feed(HarmonyParser(), pieces) == [
        ("", []),
        ("", []),
        ("One mo", []),
        ("ment", []),  # "<|e" held until it turns out to end the message
        ("", []),
        ("", []),
        ("", [CallDelta(0, "get_weather", "")]),
        ("", [CallDelta(0, None, '{"city": "Par')]),
        ("", [CallDelta(0, None, 'is"}')]),
        ("", []),
    ]


def test_harmony_final_channel_streams_as_it_is_written() -> None:
    pieces = ["<|chan", "nel|>analysis<|message|>x<|end|>", "<|start|>assistant<|channel|>final",
              "<|message|>Hel", "lo <", "|wor", "ld"]  # fmt: skip
    got = [c for c, _ in _feed(HarmonyParser(), pieces)]
    assert got == ["", "", "", "Hel", "lo ", "<|wor", "ld"]  # "<|w" opens no marker
    assert [c for c, _ in _feed(HarmonyParser(), ["<", "|x", "yz"])] == ["", "<|x", "yz"]
    assert [c for c, _ in _feed(HarmonyParser(), ["<", "hi", "!"])] == ["", "<hi", "!"]


def test_pythonic_stream_gives_each_call_whole() -> None:
    pieces = ["[", "get_weather(", 'city="Paris"', "), ", "f(", ")]"]
    assert _feed(PythonicParser(), pieces) == [
        ("", []),
        ("", []),
        ("", []),
        ("", [CallDelta(0, "get_weather", '{"city": "Paris"}')]),
        ("", []),
        ("", [CallDelta(1, "f", "{}")]),
    ]
    assert [c for c, _ in _feed(PythonicParser(), ["[", "1, 2]"])] == ["", "[1, 2]"]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def _accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether `grammar` lets a byte tokenizer write exactly `text`, then EOS."""
    masks = GrammarMasks(tokenizer, VOCAB, {EOS})
    masks.add(0, StructuredOutput(grammar=grammar))
    for byte in [*text.encode(), EOS]:
        row = masks.apply(torch.zeros(1, VOCAB), [0])[0]
        if not torch.isfinite(row[byte]):
            return False
        masks.advance([0], [byte])
    return masks.take_errors() == {}


@pytest.mark.parametrize(
    "parser,text",
    [
        (DeepSeekV3Parser(), B + _ds("get_weather", '{"city": "Paris"}') + E),
        (DeepSeekV31Parser(), f'{B}{CB}get_weather{SEP}{{"city": "Paris"}}{CE}{E}'),
        (
            HarmonyParser(),
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
            '"Paris"}',
        ),
    ],
)
def test_forced_grammar_writes_what_the_parser_reads(
    byte_tokenizer: Any, parser: ToolParser, text: str
) -> None:
    grammar = parser.forced_grammar(TOOLS, lambda _: None)  # markers as text: no such tokens
    assert _accepts(byte_tokenizer, grammar, text)
    assert parser.parse(text) == ParsedOutput(None, [WEATHER])
    assert _accepts(byte_tokenizer, grammar, text.replace("get_weather", "f")) is False  # args
    other = text.replace("get_weather", "f").replace('{"city": "Paris"}', "{}")
    assert _accepts(byte_tokenizer, grammar, other)
    assert not _accepts(byte_tokenizer, grammar, text + " ")  # nothing after the call
    # with the markers as tokens the grammar names their ids
    ids = parser.forced_grammar(TOOLS, lambda t: 1000 + len(t))
    assert "<[10" in ids
    compile_grammar(StructuredOutput(grammar=ids))
    with pytest.raises(ValueError, match="pythonic"):
        PythonicParser().forced_grammar(TOOLS, lambda _: None)


def test_detect_from_templates() -> None:
    ds_v3 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    ds_v3 += "tool['function']['name'] + '\\n' + '```json' + '\\n' + args + '\\n' + '```'}}"
    ds_v31 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args}}"
    harmony = "{{- '<|start|>assistant<|channel|>commentary to=functions.' + n + '<|message|>' }}"
    assert type(detect_tool_parser(ds_v3)) is DeepSeekV3Parser
    assert type(detect_tool_parser(ds_v31)) is DeepSeekV31Parser
    assert type(detect_tool_parser(harmony)) is HarmonyParser
    assert type(detect_tool_parser("[func_name1(params_name1=params_value1...)]")) is (
        PythonicParser
    )
    assert type(detect_tool_parser("<tool_call>")) is HermesParser
    assert type(detect_tool_parser("{{ '<|python_tag|>' }}")) is Llama3JsonParser
    assert list(tool_parsers()) == ["hermes", "mistral", "llama3_json", "deepseek_v3",
                                    "deepseek_v31", "harmony", "pythonic"]  # fmt: skip
    assert type(get_tool_parser("harmony")) is HarmonyParser
    with pytest.raises(KeyError, match="known: deepseek_v3, deepseek_v31, harmony, hermes"):
        get_tool_parser("nope")


# A DeepSeek-like template that names no tool markers and concatenates arguments as text
DSISH = (
    "{% for m in messages %}{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "[{{ c['function']['name'] + ':' + c['function']['arguments'] }}]{% endfor %}"
    "{% else %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if tools %}(tools){% endif %}"
)


def _checkpoint_tokenizer(path: Path, model_type: str, template: str) -> Any:
    from transformers import AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    save_byte_tokenizer(path, template)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return AutoTokenizer.from_pretrained(str(path))


def test_families_map_to_their_formats(tmp_path: Path) -> None:
    ds = ToolSupport(_checkpoint_tokenizer(tmp_path / "ds", "deepseek_v3", DSISH))
    assert ds.model_type == "deepseek_v3" and type(ds.parser()) is DeepSeekV3Parser
    assert type(ToolSupport(ds.tokenizer, model_type="deepseek_v2").parser()) is DeepSeekV3Parser
    assert type(ToolSupport(ds.tokenizer, model_type="gpt_oss").parser()) is HarmonyParser
    assert ToolSupport(ds.tokenizer, model_type="mixtral").parser() is None
    assert type(ToolSupport(ds.tokenizer, "hermes").parser()) is HermesParser  # named wins
    # DeepSeek's template concatenates a past call's arguments: they render as text
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}]
    ids = ds.render(msgs, None)
    assert ds.tokenizer.decode(ids) == '<user>q[f:{"a":1}]'
    dict_call = {**call, "function": {"name": "f", "arguments": {"a": 1}}}
    assert (
        template_messages([{"role": "assistant", "tool_calls": [dict_call]}], True)[0][
            "tool_calls"
        ][0]["function"]["arguments"]
        == '{"a": 1}'
    )
    assert template_messages(msgs)[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_harmony_reads_the_content_without_tools(tmp_path: Path) -> None:
    oss = ToolSupport(_checkpoint_tokenizer(tmp_path / "oss", "gpt_oss", DSISH))
    for tools, choice in ((None, None), (None, "none"), ([TOOLS[1]], "none")):
        plan, rendered = oss.plan(tools, choice)
        assert type(plan.parser) is HarmonyParser and plan.tools is False and rendered is None
        assert plan.calls(H_CALL) == ("", [])  # a call it was not offered: no call
        final = (
            "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>A"
        )
        assert plan.calls(final) == ("A", []) and plan.reasoning(final) == "x"
    plan, _ = oss.plan([TOOLS[1]], "auto")
    assert plan.tools is True and plan.calls(H_CALL) == (None, [WEATHER])
    ds = ToolSupport(_checkpoint_tokenizer(tmp_path / "ds", "deepseek_v3", DSISH))
    assert ds.plan(None, None)[0].parser is None  # only channelled formats read content


@pytest.mark.parametrize("parser,text,expected", GOLDEN)
def test_every_cut_of_an_output_parses_to_valid_calls(
    parser: ToolParser, text: str, expected: ParsedOutput
) -> None:
    """An output cut anywhere (max_tokens) parses without error; any call it gives has a name
    and a JSON object for arguments, else the text is all content."""
    for k in range(len(text) + 1):
        got = parser.parse(text[:k])
        for call in got.calls:
            assert call.name and isinstance(json.loads(call.arguments), dict), (k, got)
        if not got.calls and parser.locate(text[:k]) is not None:
            assert got.content == (text[:k] or None)
