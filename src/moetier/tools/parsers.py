"""Tool-call formats: parsing model output into OpenAI tool calls, whole or as it streams.

One small class per format behind a registry (`hermes`: Qwen/Hermes
`<tool_call>{...}</tool_call>`, `mistral`: `[TOOL_CALLS][{...}, ...]`, `llama3_json`: Llama 3.x's
bare `{"name": ..., "parameters": ...}`, `deepseek_v3` / `deepseek_v31`: DeepSeek's
`<｜tool▁call▁begin｜>` blocks, `harmony`: gpt-oss's channels and `to=functions.NAME` messages,
`pythonic`: `[f(a=1)]`); each also writes the grammar that forces a call in its format. Plain
text in, plain data out: no engine, no HTTP.

A call's `arguments` is the JSON text of its arguments object exactly as the model wrote it, so
a stream's argument deltas concatenate to the same string the whole-output parse returns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

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
class _Partial:
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


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def scan_call_object(s: str, i: int, closed: bool) -> tuple[_Partial | None, int | None]:
    """The call object `{"name": ..., "arguments": {...}}` starting at or after s[i]: (what is
    known of it, index after it or None while incomplete). `closed`: no more text will come;
    then an incomplete or invalid object gives (None, None)."""
    i = _skip_ws(s, i)
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
        return _Partial(obj["name"], text, True), end
    if closed:
        return None, None
    head = _HEAD.match(s, i)
    if head is None:
        return _Partial(None, "", False), None
    name = json.loads(head.group(1))
    stop = value_end(s, head.end())
    rest = s[head.end() : stop]  # the arguments so far, and never what follows them
    # a string-valued arguments field is decoded once complete; an object streams as written
    return _Partial(name, "" if rest.startswith('"') else rest, False), None


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
        return _marker_prefix(text, self.start)

    def visible(self, text: str, final: bool) -> str:
        """The content shown for `text`, the output before any call (all of it when `final`,
        else without what may still open a call). Only ever grows as `text` does: a stream
        sends what it adds."""
        return text if final else text[: len(text) - self.undecided(text)]

    def reasoning(self, text: str, final: bool) -> str:
        """The reasoning the format sets apart in `text` (grows as `visible` does)."""
        return ""

    def scan(self, section: str, final: bool) -> list[_Partial] | None:
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


def _literal(text: str) -> str:
    return json.dumps(text)


class HermesParser(ToolParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call
    (Hermes 2 Pro, Qwen2.5/Qwen3, the demo model's template)."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def scan(self, section: str, final: bool) -> list[_Partial] | None:
        calls: list[_Partial] = []
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
        return f"start: {_literal(self.start + chr(10))} {body} {_literal(chr(10) + self.end)}"


class MistralParser(ToolParser):
    """`[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (Mistral 7B v0.3, Mixtral 8x22B,
    Mistral Nemo). `[TOOL_CALLS]` is a special token: the output must keep special tokens."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def scan(self, section: str, final: bool) -> list[_Partial] | None:
        calls: list[_Partial] = []
        i = _skip_ws(section, 0)
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
            i = _skip_ws(section, end)
            if i < len(section) and section[i] == ",":
                i += 1
                continue
            if final and (i >= len(section) or section[i] != "]"):
                return None
            return calls

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        tid = token_id(self.start)
        opener = f"<[{tid}]>" if tid is not None else _literal(self.start)
        return f'start: {opener} "[" {json_grammar_text(call_schema(tools))} "]"'


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

    def scan(self, section: str, final: bool) -> list[_Partial] | None:
        calls: list[_Partial] = []
        i = 0
        while True:
            call, end = scan_call_object(section, i, closed=final)
            if call is None:
                return None if final else calls
            calls.append(call)
            if end is None:
                return calls
            i = _skip_ws(section, end)
            if i < len(section) and section[i] == ";":
                i += 1
                continue
            return None if final and i < len(section) else calls

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        return f"start: {json_grammar_text(call_schema(tools, 'parameters'))}"


def _token(token_id: Callable[[str], Any], text: str) -> str:
    """A grammar item for a marker: its token (`<[id]>`) when it is one, else its text."""
    tid = token_id(text)
    return f"<[{tid}]>" if tid is not None else _literal(text)


def _closing(s: str, k: int, tail: list[str], final: bool) -> tuple[bool | None, int]:
    """Match the markers `tail` (whitespace between them allowed) at s[k:]: (True, index after
    them) when all are there or the text ends early at `final` (an output cut at EOS), (False,
    k) while the rest of the text may still become them, (None, k) when it cannot."""
    for marker in tail:
        k = _skip_ws(s, k)
        if s.startswith(marker, k):
            k += len(marker)
            continue
        rest = s[k:]
        if not rest:
            return (True, k) if final else (False, k)
        return (False, k) if not final and marker.startswith(rest) else (None, k)
    return True, k


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALLS_END = "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_CALL_END = "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"
_FENCE_OPEN = "```json"
_FENCE_CLOSE = "```"


class DeepSeekV3Parser(ToolParser):
    """DeepSeek-V2.5/V3/R1: `<｜tool▁calls▁begin｜>` then per call
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`,
    then `<｜tool▁calls▁end｜>`. Also reads V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
    <｜tool▁call▁end｜>` (arguments right after the separator). The markers are added tokens:
    the output keeps special tokens."""

    name = "deepseek_v3"
    start = _DS_CALLS_BEGIN
    keeps_special_tokens = True
    text_arguments = True  # the template concatenates a past call's arguments as text

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return cls.start in chat_template and _FENCE_OPEN in chat_template

    def scan(self, section: str, final: bool) -> list[_Partial] | None:
        calls: list[_Partial] = []
        i = 0
        while True:
            i = _skip_ws(section, i)
            rest = section[i:]
            if not rest or rest.startswith(_DS_CALLS_END):
                return calls if calls or not final else None
            if not rest.startswith(_DS_CALL_BEGIN):
                maybe = _DS_CALL_BEGIN.startswith(rest) or _DS_CALLS_END.startswith(rest)
                return calls if not final and maybe else (None if final else calls)
            call, end = self._call(section, i + len(_DS_CALL_BEGIN), final)
            if call is None:
                return None if final else calls
            calls.append(call)
            if end is None:
                return calls
            i = end

    def _call(self, s: str, i: int, final: bool) -> tuple[_Partial | None, int | None]:
        """One call after its begin marker: (what is known, index after it or None)."""
        pending: tuple[_Partial | None, int | None] = (
            (None, None) if final else (_Partial(None, "", False), None)
        )
        sep = s.find(_DS_SEP, i)
        if sep < 0:
            return pending
        head, j = s[i:sep].strip(), sep + len(_DS_SEP)
        if j >= len(s):
            return pending
        if s[j] == "{":  # V3.1: the name before the separator, the arguments after it
            name, a, tail = head, j, [_DS_CALL_END]
        else:  # V3: the type before it, then the name line and the fenced arguments
            nl = s.find("\n", j)
            if nl < 0:
                return pending
            name = s[j:nl].strip()
            done, k = _closing(s, nl, [_FENCE_OPEN], final=False)
            if done is None or not name:
                return None, None
            if not done:
                return (None, None) if final else (_Partial(name, "", False), None)
            a, tail = _skip_ws(s, k), [_FENCE_CLOSE, _DS_CALL_END]
        if not name:
            return None, None
        if a >= len(s):
            return (None, None) if final else (_Partial(name, "", False), None)
        if s[a] != "{":
            return None, None
        stop = value_end(s, a)
        if stop is None:
            return (None, None) if final else (_Partial(name, s[a:], False), None)
        args = s[a:stop]
        if not _json_object(args):
            return None, None
        done, k = _closing(s, stop, tail, final)
        if done is None:
            return None, None
        return (_Partial(name, args, True), k) if done else (_Partial(name, args, False), None)

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        begin, sep, end = (_token(token_id, t) for t in (_DS_CALL_BEGIN, _DS_SEP, _DS_CALL_END))
        rules = []
        for k, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            rules.append(f"call_{k}: {begin} {self._head(fn['name'], sep)} "
                         f"{json_grammar_text(params)} {self._tail()} {end}")  # fmt: skip
        alts = " | ".join(f"call_{k}" for k in range(len(tools)))
        opener, closer = _token(token_id, _DS_CALLS_BEGIN), _token(token_id, _DS_CALLS_END)
        return "\n".join([f"start: {opener} ({alts}) {closer}", *rules])

    def _head(self, name: str, sep: str) -> str:
        return f'"function" {sep} {_literal(name + chr(10) + _FENCE_OPEN + chr(10))}'

    def _tail(self) -> str:
        return _literal(chr(10) + _FENCE_CLOSE)


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1's calls, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`:
    read as DeepSeekV3Parser reads them; a forced call is written this way."""

    name = "deepseek_v31"

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return cls.start in chat_template and _DS_SEP in chat_template

    def _head(self, name: str, sep: str) -> str:
        return f"{_literal(name)} {sep}"

    def _tail(self) -> str:
        return ""


_H_START, _H_CHANNEL, _H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_H_CONSTRAIN = "<|constrain|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_RECIPIENT = re.compile(r"to=([^\s<]+)")
_H_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_]+)")


@dataclass
class _HarmonyMessage:
    """One message of a harmony output: where it starts, its header (role, channel, recipient,
    content type; complete once `<|message|>` is seen) and its body so far."""

    start: int
    header: str
    header_done: bool
    body: str = ""
    ended: bool = False

    @property
    def recipient(self) -> str | None:
        m = _H_RECIPIENT.search(self.header)
        return m.group(1) if m else None

    @property
    def channel(self) -> str | None:
        m = _H_CHANNEL_NAME.search(self.header)
        return m.group(1) if m else None


def _harmony_messages(text: str) -> list[_HarmonyMessage]:
    """The messages of `text` (the first one's `<|start|>assistant` is the prompt's)."""
    out: list[_HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        start = pos
        if text.startswith(_H_START, pos):
            pos += len(_H_START)
        h = text.find(_H_MESSAGE, pos)
        if h < 0:
            out.append(_HarmonyMessage(start, text[pos:], False))
            break
        b = h + len(_H_MESSAGE)
        ends = [(e, m) for m in _H_ENDS if (e := text.find(m, b)) >= 0]
        if not ends:
            out.append(_HarmonyMessage(start, text[pos:h], True, text[b:]))
            break
        e, marker = min(ends)
        out.append(_HarmonyMessage(start, text[pos:h], True, text[b:e], True))
        pos = e + len(marker)
    return out


def _held(body: str) -> int:
    """Characters at the end of a body that may be the start of a marker ending it."""
    return max(_marker_prefix(body, m) for m in (*_H_ENDS, _H_START))


_HARMONY_OPENERS = (_H_CHANNEL, _H_START, _H_CONSTRAIN, _H_MESSAGE, " to=", "to=")


class HarmonyParser(ToolParser):
    """gpt-oss's harmony messages: `<|channel|>analysis<|message|>...<|end|>` (reasoning, not
    shown), `<|start|>assistant<|channel|>final<|message|>...` (the content) and calls as
    `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
    {...}<|call|>` (the recipient may also follow the role). The markers are special tokens:
    the output keeps them. Text that is not harmony at all is content as it is."""

    name = "harmony"
    start = "to=functions."
    keeps_special_tokens = True
    channels = True  # the content is read out of channels even when no tools are asked for

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return _H_CHANNEL in chat_template and _H_MESSAGE in chat_template

    @staticmethod
    def _plain(text: str) -> bool | None:
        """Whether the output is not harmony (None: too little of it to tell)."""
        body = text.lstrip()
        if any(body.startswith(o) for o in _HARMONY_OPENERS):
            return False
        return None if any(o.startswith(body) for o in _HARMONY_OPENERS) else True

    def locate(self, text: str) -> tuple[int, int] | None:
        if self._plain(text) is not False:
            return None
        for m in _harmony_messages(text):
            if (m.recipient or "").startswith("functions.") or (
                not m.header_done and "to=functions." in m.header
            ):
                return m.start, m.start
        return None

    def undecided(self, text: str) -> int:
        return len(text) if self._plain(text) is None else 0

    def visible(self, text: str, final: bool) -> str:
        plain = self._plain(text)
        if plain or (plain is None and final):
            return text
        if plain is None:
            return ""
        return self._bodies(text, final, analysis=False)

    def reasoning(self, text: str, final: bool) -> str:
        return "" if self._plain(text) is not False else self._bodies(text, final, analysis=True)

    def _bodies(self, text: str, final: bool, analysis: bool) -> str:
        """The bodies of the analysis messages, or of the shown ones (final, plain commentary),
        one per line; a body's end that may open a marker is held back unless `final`."""
        shown = ""
        for m in _harmony_messages(text):
            if not m.header_done or m.recipient is not None:
                continue
            if (m.channel == "analysis") != analysis:
                continue
            body = m.body if m.ended or final else m.body[: len(m.body) - _held(m.body)]
            if body:
                shown += ("\n" if shown else "") + body
        return shown

    def scan(self, section: str, final: bool) -> list[_Partial] | None:
        calls: list[_Partial] = []
        for m in _harmony_messages(section):
            to = m.recipient
            if not m.header_done:
                if to is not None and to.startswith("functions."):
                    calls.append(_Partial(None, "", False))  # the name may still grow
                break
            if to is None or not to.startswith("functions."):
                continue  # reasoning between calls
            name = to[len("functions.") :]
            done = m.ended or final
            body = m.body if done else m.body[: len(m.body) - _held(m.body)]
            a = _skip_ws(body, 0)
            stop = value_end(body, a) if a < len(body) else None
            if stop is None:
                if done:
                    return None
                calls.append(_Partial(name, body[a:] if body[a : a + 1] == "{" else "", False))
                break
            args = body[a:stop]
            if body[a] != "{" or not _json_object(args) or body[stop:].strip():
                return None if final else calls
            calls.append(_Partial(name, args, done))
        return calls if calls or not final else None

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        channel, constrain, message = (
            _token(token_id, t) for t in (_H_CHANNEL, _H_CONSTRAIN, _H_MESSAGE)
        )
        rules = []
        for k, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            head = _literal(f"commentary to=functions.{fn['name']} ")
            rules.append(f'call_{k}: {head} {constrain} "json" {message} '
                         f"{json_grammar_text(params)}")  # fmt: skip
        alts = " | ".join(f"call_{k}" for k in range(len(tools)))
        return "\n".join([f"start: {channel} ({alts})", *rules])


_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
_PY_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_PY_MAYBE = re.compile(r"(\[\s*([A-Za-z_][\w.]*\s*)?)?")


def _python_end(s: str, i: int) -> tuple[list[int], int | None]:
    """Top-level element boundaries of the Python list starting at s[i] == '[': (indices of
    the commas between elements, index after the closing ']' or None while it is open)."""
    depth, j, quote = 0, i, ""
    commas: list[int] = []
    while j < len(s):
        c = s[j]
        if quote:
            if c == "\\":
                j += 1
            elif s.startswith(quote, j):
                j += len(quote) - 1
                quote = ""
        elif c in "'\"":
            quote = c * 3 if s.startswith(c * 3, j) else c
            j += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return commas, j + 1
        elif c == "," and depth == 1:
            commas.append(j)
        j += 1
    return commas, None


def _python_call(text: str) -> ToolCall | None:
    """`name(a=1, b="x")` as a call with JSON arguments; None unless it is one, with keyword
    arguments whose values are Python literals."""
    import ast

    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        return None
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError):
            return None
    try:
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, a complex)
        return None


class PythonicParser(ToolParser):
    """Python-style calls, `[get_weather(city="Paris"), get_time(tz="UTC")]` (Llama 4 and 3.2
    with a pythonic template), optionally inside `<|python_start|>...<|python_end|>`; only an
    answer that starts with them is a call. Arguments become JSON text (`{"city": "Paris"}`);
    a stream gives each call whole once its closing parenthesis is written."""

    name = "pythonic"
    start = _PY_START

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return "[func_name1(" in chat_template

    def locate(self, text: str) -> tuple[int, int] | None:
        body = text.lstrip()
        lead = len(text) - len(body)
        if body.startswith(self.start):
            return 0, lead + len(self.start)
        return (0, lead) if _PY_HEAD.match(body) else None

    def undecided(self, text: str) -> int:
        body = text.lstrip()
        maybe = self.start.startswith(body) or _PY_MAYBE.fullmatch(body) is not None
        return len(text) if maybe else 0

    def scan(self, section: str, final: bool) -> list[_Partial] | None:
        i = _skip_ws(section, 0)
        if i >= len(section) or section[i] != "[":
            return None if final or i < len(section) else []
        commas, end = _python_end(section, i)
        bounds = [i, *commas, end] if end is not None else [i, *commas]
        calls: list[_Partial] = []
        for a, b in zip(bounds, bounds[1:]):
            part = section[a + 1 : b - 1 if b == end else b]
            call = _python_call(part)
            if call is None:
                return None if final else calls
            calls.append(_Partial(call.name, call.arguments, True))
        if end is None or not final:
            return None if final else calls
        return calls if calls and section[end:].strip() in ("", _PY_END) else None

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        raise ValueError(
            "the pythonic format cannot force a call with a grammar (its arguments are Python, "
            "not JSON); use tool_choice auto"
        )


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HarmonyParser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        HermesParser,
        MistralParser,
        Llama3JsonParser,
        PythonicParser,
    )
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise KeyError(f"unknown tool-call format {name!r}; known: {known}")
    return TOOL_PARSERS[name]()


def detect_tool_parser(chat_template: str) -> ToolParser | None:
    """The format a chat template writes calls in (by its marker); None if none is known."""
    for cls in TOOL_PARSERS.values():
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


def _marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
