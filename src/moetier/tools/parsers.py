"""Tool-call formats: parsing model output into OpenAI tool calls, whole or as it streams.

One small class per format behind a registry: here the JSON-call formats (`hermes`: Qwen/Hermes
`<tool_call>{...}</tool_call>`, `mistral`: `[TOOL_CALLS][{...}, ...]`, `llama3_json`: Llama 3.x's
bare `{"name": ..., "parameters": ...}`) and what every format shares (the stream, JSON and
marker scanning); in their own modules `deepseek_v3` / `deepseek_v31` (deepseek.py), `harmony`
(harmony.py, gpt-oss) and `pythonic` (pythonic.py). Each also writes the grammar that forces a
call in its format. Plain text in, plain data out: no engine, no HTTP.

A call's `arguments` is the JSON text of its arguments object exactly as the model wrote it, so
a stream's argument deltas concatenate to the same string the whole-output parse returns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from moetier.core import ToolCall as ToolCall  # defined in core: outputs carry it
from moetier.engine.structured import json_grammar_text


@dataclass
class ParsedOutput:
    content: str | None  # text before the first call (None when there is none)
    calls: list[ToolCall]
    reasoning: str | None = None  # set apart by the format (harmony's analysis channel)


@dataclass
class CallDelta:
    """New output of call `index`: its name the first time (then None), and argument text."""

    index: int
    name: str | None
    arguments: str


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    reasoning: str = ""


@dataclass
class PartialCall:
    """A call as far as it is written: name once complete, arguments text so far."""

    name: str | None
    arguments: str
    complete: bool


_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")


def _string_end(s: str, i: int) -> int | None:
    """Index after the JSON string starting at s[i] == '"', or None if it is not closed."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """Index after the JSON value starting at s[i] (no leading whitespace), or None while it
    is incomplete. Only brackets and strings are tracked: validity is json.loads's job."""
    if i >= len(s):
        return None
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] not in "{[":
        m = _SCALAR.match(s, i)
        # a scalar at the end of the text may still grow ("12" -> "123")
        return m.end() if m and m.end() < len(s) else None
    depth, j = 0, i
    while j < len(s):
        c = s[j]
        if c == '"':
            end = _string_end(s, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def scan_call_object(s: str, i: int, closed: bool) -> tuple[PartialCall | None, int | None]:
    """The call object `{"name": ..., "arguments": {...}}` starting at or after s[i]: (what is
    known of it, index after it or None while incomplete). `closed`: no more text will come;
    then an incomplete or invalid object gives (None, None)."""
    i = skip_ws(s, i)
    end = value_end(s, i)
    if end is not None:
        try:
            obj = json.loads(s[i:end])
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, None
        head = _HEAD.match(s, i)
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            text = args
        elif head is not None and (stop := value_end(s, head.end())) is not None:
            text = s[head.end() : stop]  # as written
        else:
            text = json.dumps(args, ensure_ascii=False)
        return PartialCall(obj["name"], text, True), end
    if closed:
        return None, None
    head = _HEAD.match(s, i)
    if head is None:
        return PartialCall(None, "", False), None
    name = json.loads(head.group(1))
    stop = value_end(s, head.end())
    rest = s[head.end() : stop]  # the arguments so far, and never what follows them
    # a string-valued arguments field is decoded once complete; an object streams as written
    return PartialCall(name, "" if rest.startswith('"') else rest, False), None


class ToolParser:
    """A tool-call format: `start` opens the calls; subclasses scan the text after it."""

    name: ClassVar[str]
    start: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False  # the marker is a special token
    text_arguments: ClassVar[bool] = False  # templates take past calls' arguments as JSON text
    channels: ClassVar[bool] = False  # the content itself needs parsing, with or without tools

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        """Whether a chat template writes calls in this format."""
        return cls.start in chat_template

    def locate(self, text: str) -> tuple[int, int] | None:
        """(where the content ends, where the calls' text starts), or None: no call yet."""
        at = text.find(self.start)
        return None if at < 0 else (at, at + len(self.start))

    def undecided(self, text: str) -> int:
        """How many characters at the end of `text` (no call located in it) may still turn
        out to open a call: a stream holds them back."""
        return marker_prefix(text, self.start)

    def visible(self, text: str, final: bool) -> str:
        """The content shown for `text`, the output before any call (all of it when `final`,
        else without what may still open a call). Only ever grows as `text` does: a stream
        sends what it adds."""
        return text if final else text[: len(text) - self.undecided(text)]

    def reasoning(self, text: str, final: bool) -> str:
        """The reasoning the format sets apart in `text` (grows as `visible` does)."""
        return ""

    def scan(self, section: str, final: bool) -> list[PartialCall] | None:
        """Calls in the text after `start` (the last may be partial unless final); None when
        final and the calls are malformed."""
        raise NotImplementedError

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        """A Lark grammar (llguidance) for exactly one call to one of `tools` (OpenAI function
        tool dicts) whose arguments match its parameter schema."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        """The whole output: content before the first call and the calls; malformed calls
        leave everything as content (the caller sees what the model wrote)."""
        reasoning = self.reasoning(text, True) or None
        found = self.locate(text)
        if found is None:
            return ParsedOutput(self.visible(text, True) or None, [], reasoning)
        calls = self.scan(text[found[1] :], final=True)
        if not calls or not all(c.complete and c.name is not None for c in calls):
            return ParsedOutput(text or None, [])
        content = self.visible(text[: found[0]], True) or None
        made = [ToolCall(c.name or "", c.arguments) for c in calls]
        return ParsedOutput(content, made, reasoning)

    def stream(self) -> ToolStream:
        return ToolStream(self)


def call_schema(tools: list[dict[str, Any]], key: str = "arguments") -> dict[str, Any]:
    """JSON schema of one `{"name": ..., "<key>": {...}}` object calling one of `tools`.

    The tools' `$defs` / `definitions` move to the root, where their `#/$defs/...` references
    (pydantic writes them) point from inside it; ValueError if two tools define one name
    differently."""
    options = []
    hoisted: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool["function"]
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        for defs in ("$defs", "definitions"):
            for name, value in (params.pop(defs, None) or {}).items():
                seen = hoisted.setdefault(defs, {})
                if seen.setdefault(name, value) != value:
                    raise ValueError(
                        f"tools define {defs}/{name} differently; give the definitions "
                        "distinct names"
                    )
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, **hoisted}


TOOL_PARSERS: dict[str, type[ToolParser]] = {}  # name -> format, in registration order
_P = TypeVar("_P", bound=type[ToolParser])


def register(cls: _P) -> _P:
    TOOL_PARSERS[cls.name] = cls
    return cls


def grammar_literal(text: str) -> str:
    return json.dumps(text)


@register
class HermesParser(ToolParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call
    (Hermes 2 Pro, Qwen2.5/Qwen3, the demo model's template)."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def scan(self, section: str, final: bool) -> list[PartialCall] | None:
        calls: list[PartialCall] = []
        pos = 0
        while True:
            close = section.find(self.end, pos)
            body = section[pos : close if close >= 0 else len(section)]
            call, _ = scan_call_object(body, 0, closed=final or close >= 0)
            if call is None:
                return None if final else calls
            calls.append(call)
            if close < 0:
                return calls
            nxt = section.find(self.start, close)
            if nxt < 0:
                return calls
            pos = nxt + len(self.start)

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        body = json_grammar_text(call_schema(tools))
        opener, closer = grammar_literal(self.start + "\n"), grammar_literal("\n" + self.end)
        return f"start: {opener} {body} {closer}"


@register
class MistralParser(ToolParser):
    """`[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (Mistral 7B v0.3, Mixtral 8x22B,
    Mistral Nemo). `[TOOL_CALLS]` is a special token: the output must keep special tokens."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def scan(self, section: str, final: bool) -> list[PartialCall] | None:
        calls: list[PartialCall] = []
        i = skip_ws(section, 0)
        if i >= len(section) or section[i] != "[":
            return None if final or i < len(section) else calls
        i += 1
        while True:
            call, end = scan_call_object(section, i, closed=final)
            if call is None:
                return None if final else calls
            calls.append(call)
            if end is None:
                return calls
            i = skip_ws(section, end)
            if i < len(section) and section[i] == ",":
                i += 1
                continue
            if final and (i >= len(section) or section[i] != "]"):
                return None
            return calls

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        tid = token_id(self.start)
        opener = f"<[{tid}]>" if tid is not None else grammar_literal(self.start)
        return f'start: {opener} "[" {json_grammar_text(call_schema(tools))} "]"'


@register
class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3's JSON calls: the answer is `{"name": "f", "parameters": {...}}` (after
    `<|python_tag|>` or alone), several separated by `;`. Only an answer that starts with one
    is a call."""

    name = "llama3_json"
    start = "<|python_tag|>"

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return cls.start in chat_template or "dictionary of argument name" in chat_template

    def locate(self, text: str) -> tuple[int, int] | None:
        body = text.lstrip()
        lead = len(text) - len(body)
        if body.startswith(self.start):
            return 0, lead + len(self.start)
        return (0, lead) if body.startswith("{") else None

    def undecided(self, text: str) -> int:
        return len(text) if self.start.startswith(text.lstrip()) else 0

    def scan(self, section: str, final: bool) -> list[PartialCall] | None:
        calls: list[PartialCall] = []
        i = 0
        while True:
            call, end = scan_call_object(section, i, closed=final)
            if call is None:
                return None if final else calls
            calls.append(call)
            if end is None:
                return calls
            i = skip_ws(section, end)
            if i < len(section) and section[i] == ";":
                i += 1
                continue
            return None if final and i < len(section) else calls

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        return f"start: {json_grammar_text(call_schema(tools, 'parameters'))}"


def marker_item(token_id: Callable[[str], Any], text: str) -> str:
    """A grammar item for a marker: its token (`<[id]>`) when it is one, else its text."""
    tid = token_id(text)
    return f"<[{tid}]>" if tid is not None else grammar_literal(text)


def closing_markers(s: str, k: int, tail: list[str], final: bool) -> tuple[bool | None, int]:
    """Match the markers `tail` (whitespace between them allowed) at s[k:]: (True, index after
    them) when all are there or the text ends early at `final` (an output cut at EOS), (False,
    k) while the rest of the text may still become them, (None, k) when it cannot."""
    for marker in tail:
        k = skip_ws(s, k)
        if s.startswith(marker, k):
            k += len(marker)
            continue
        rest = s[k:]
        if not rest:
            return (True, k) if final else (False, k)
        return (False, k) if not final and marker.startswith(rest) else (None, k)
    return True, k


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _load_builtin() -> None:
    # Importing a format module registers it (after this module's own formats).
    from moetier.tools import deepseek, harmony, pythonic  # noqa: F401


def tool_parsers() -> dict[str, type[ToolParser]]:
    """Every known format by name, in detection order."""
    _load_builtin()
    return TOOL_PARSERS


def get_tool_parser(name: str) -> ToolParser:
    parsers = tool_parsers()
    if name not in parsers:
        known = ", ".join(sorted(parsers))
        raise KeyError(f"unknown tool-call format {name!r}; known: {known}")
    return parsers[name]()


def detect_tool_parser(chat_template: str) -> ToolParser | None:
    """The format a chat template writes calls in (by its marker); None if none is known.
    Formats are tried in registration order; their markers do not overlap."""
    for cls in tool_parsers().values():
        if cls.detect(chat_template):
            return cls()
    return None


class ToolStream:
    """Incremental parse of a streamed output: text before the first call goes out as content
    (held back only while it could be the start of the marker), then each call's name and
    argument text as they become known."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of content handed out
        self.section: int | None = None  # where the calls start in `text`
        self.args_sent: list[int] = []  # per call: argument characters handed out
        self.reasoning_sent = 0

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        self.text += delta
        out = StreamDelta()
        reasoning = self.parser.reasoning(self.text, final)
        out.reasoning = reasoning[self.reasoning_sent :]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        if self.section is None:
            found = self.parser.locate(self.text)
            if found is None:
                shown = self.parser.visible(self.text, final)
                out.content = shown[self.sent :]
                self.sent = max(self.sent, len(shown))
                return out
            shown = self.parser.visible(self.text[: found[0]], True)
            out.content = shown[self.sent :]
            self.sent = max(self.sent, len(shown))
            self.section = found[1]
        calls = self.parser.scan(self.text[self.section :], final=False) or []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self.args_sent):
                out.calls.append(CallDelta(i, call.name, call.arguments))
                self.args_sent.append(len(call.arguments))
            elif len(call.arguments) > self.args_sent[i]:
                out.calls.append(CallDelta(i, None, call.arguments[self.args_sent[i] :]))
                self.args_sent[i] = len(call.arguments)
        return out

    @property
    def called(self) -> bool:
        return bool(self.args_sent)


def marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
