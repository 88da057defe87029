"""Python-style tool calls, `[f(a=1), g(b="x")]`: parsed whole or call by call as they stream,
arguments turned into JSON. Plain text in, plain data out.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from moetier.tools.parsers import PartialCall, ToolCall, ToolParser, register, skip_ws

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


@register
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

    def scan(self, section: str, final: bool) -> list[PartialCall] | None:
        i = skip_ws(section, 0)
        if i >= len(section) or section[i] != "[":
            return None if final or i < len(section) else []
        commas, end = _python_end(section, i)
        bounds = [i, *commas, end] if end is not None else [i, *commas]
        calls: list[PartialCall] = []
        for a, b in zip(bounds, bounds[1:]):
            part = section[a + 1 : b - 1 if b == end else b]
            call = _python_call(part)
            if call is None:
                return None if final else calls
            calls.append(PartialCall(call.name, call.arguments, True))
        if end is None or not final:
            return None if final else calls
        return calls if calls and section[end:].strip() in ("", _PY_END) else None

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        raise ValueError(
            "the pythonic format cannot force a call with a grammar (its arguments are Python, "
            "not JSON); use tool_choice auto"
        )
