"""gpt-oss's harmony format: the output's messages and channels (content, reasoning, calls to
`functions.NAME`), parsed whole or as they stream, and the grammar that forces a call. A pure
text parser: the openai-harmony package needs its tokenizer vocabulary downloaded at run time,
and the parsers here read text, not token ids.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moetier.engine.structured import json_grammar_text
from moetier.tools.parsers import (
    PartialCall,
    ToolParser,
    grammar_literal,
    is_json_object,
    marker_item,
    marker_prefix,
    register,
    skip_ws,
    value_end,
)

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
    return max(marker_prefix(body, m) for m in (*_H_ENDS, _H_START))


_HARMONY_OPENERS = (_H_CHANNEL, _H_START, _H_CONSTRAIN, _H_MESSAGE, " to=", "to=")


@register
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

    def scan(self, section: str, final: bool) -> list[PartialCall] | None:
        calls: list[PartialCall] = []
        for m in _harmony_messages(section):
            to = m.recipient
            if not m.header_done:
                if to is not None and to.startswith("functions."):
                    calls.append(PartialCall(None, "", False))  # the name may still grow
                break
            if to is None or not to.startswith("functions."):
                continue  # reasoning between calls
            name = to[len("functions.") :]
            done = m.ended or final
            body = m.body if done else m.body[: len(m.body) - _held(m.body)]
            a = skip_ws(body, 0)
            stop = value_end(body, a) if a < len(body) else None
            if stop is None:
                if done:
                    return None
                calls.append(PartialCall(name, body[a:] if body[a : a + 1] == "{" else "", False))
                break
            args = body[a:stop]
            if body[a] != "{" or not is_json_object(args) or body[stop:].strip():
                return None if final else calls
            calls.append(PartialCall(name, args, done))
        return calls if calls or not final else None

    def forced_grammar(self, tools: list[dict[str, Any]], token_id: Callable[[str], Any]) -> str:
        channel, constrain, message = (
            marker_item(token_id, t) for t in (_H_CHANNEL, _H_CONSTRAIN, _H_MESSAGE)
        )
        rules = []
        for k, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            head = grammar_literal(f"commentary to=functions.{fn['name']} ")
            rules.append(f'call_{k}: {head} {constrain} "json" {message} '
                         f"{json_grammar_text(params)}")  # fmt: skip
        alts = " | ".join(f"call_{k}" for k in range(len(tools)))
        return "\n".join([f"start: {channel} ({alts})", *rules])
