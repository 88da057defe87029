"""DeepSeek's tool calls (V2.5/V3/R1 and V3.1): its tool-call tokens around each call, parsed
whole or as they stream, and the grammar that forces one. Plain text in, plain data out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moetier.engine.structured import json_grammar_text
from moetier.tools.parsers import (
    PartialCall,
    ToolParser,
    closing_markers,
    grammar_literal,
    is_json_object,
    marker_item,
    register,
    skip_ws,
    value_end,
)

_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALLS_END = "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_CALL_END = "<｜tool▁call▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"
_FENCE_OPEN = "```json"
_FENCE_CLOSE = "```"


@register
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

    def scan(self, section: str, final: bool) -> list[PartialCall] | None:
        calls: list[PartialCall] = []
        i = 0
        while True:
            i = skip_ws(section, i)
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

    def _call(self, s: str, i: int, final: bool) -> tuple[PartialCall | None, int | None]:
        """One call after its begin marker: (what is known, index after it or None)."""
        pending: tuple[PartialCall | None, int | None] = (
            (None, None) if final else (PartialCall(None, "", False), None)
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
            done, k = closing_markers(s, nl, [_FENCE_OPEN], final=False)
            if done is None or not name:
                return None, None
            if not done:
                return (None, None) if final else (PartialCall(name, "", False), None)
            a, tail = skip_ws(s, k), [_FENCE_CLOSE, _DS_CALL_END]
        if not name:
            return None, None
        if a >= len(s):
            return (None, None) if final else (PartialCall(name, "", False), None)
        if s[a] != "{":
            return None, None
        stop = value_end(s, a)
        if stop is None:
            return (None, None) if final else (PartialCall(name, s[a:], False), None)
        args = s[a:stop]
        if not is_json_object(args):
            return None, None
        done, k = closing_markers(s, stop, tail, final)
        if done is None:
            return None, None
        return (
            (PartialCall(name, args, True), k) if done else (PartialCall(name, args, False), None)
        )

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        begin, sep, end = (
            marker_item(token_id, t) for t in (_DS_CALL_BEGIN, _DS_SEP, _DS_CALL_END)
        )
        rules = []
        for k, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            rules.append(f"call_{k}: {begin} {self._head(fn['name'], sep)} "
                         f"{json_grammar_text(params)} {self._tail()} {end}")  # fmt: skip
        alts = " | ".join(f"call_{k}" for k in range(len(tools)))
        opener, closer = (
            marker_item(token_id, _DS_CALLS_BEGIN),
            marker_item(token_id, _DS_CALLS_END),
        )
        return "\n".join([f"start: {opener} ({alts}) {closer}", *rules])

    def _head(self, name: str, sep: str) -> str:
        return f'"function" {sep} {grammar_literal(name + chr(10) + _FENCE_OPEN + chr(10))}'

    def _tail(self) -> str:
        return grammar_literal(chr(10) + _FENCE_CLOSE)


@register
class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1's calls, `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`:
    read as DeepSeekV3Parser reads them; a forced call is written this way."""

    name = "deepseek_v31"

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return cls.start in chat_template and _DS_SEP in chat_template

    def _head(self, name: str, sep: str) -> str:
        return f"{grammar_literal(name)} {sep}"

    def _tail(self) -> str:
        return ""
