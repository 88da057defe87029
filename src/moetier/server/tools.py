"""Tools in chat completions: template rendering with tools, tool_choice, and the response shapes.

Owns what a request's `tools`, `tool_choice` and tool messages mean for the prompt and for the
answer: the conversation rendered by the model's own chat template (`tools=` as transformers
passes them), whether that template knows tools at all, the grammar that forces a call, and the
OpenAI `tool_calls` of a whole answer or of a stream's deltas. Formats are tool_parsers.py's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from moetier.core import StructuredOutput
from moetier.server.protocol import ChatCompletionRequest
from moetier.server.tool_parsers import (
    TOOL_PARSERS,
    StreamDelta,
    ToolParser,
    ToolStream,
    detect_tool_parser,
    get_tool_parser,
)

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "moetier_probe",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


class ToolError(ValueError):
    """A request's tools cannot be served as asked (answered 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    """How one chat request uses tools: the format to parse (None: no tools), the grammar that
    forces a call (tool_choice required or named), and whether several calls may be returned."""

    parser: ToolParser | None = None
    forced: StructuredOutput | None = None
    parallel: bool = True


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(text: str) -> Any:
    """Arguments of a past call as templates expect them: a dict when the text is JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as chat-template input (past calls' arguments as dicts, as
    transformers' templates take them)."""
    out = []
    for m in body.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        out.append(d)
    return out


def _ids(rendered: Any) -> list[int]:
    if not isinstance(rendered, list):
        rendered = list(rendered["input_ids"])
    return [int(t) for t in rendered]


class ToolSupport:
    """Per server: the tokenizer's chat template, its tool format, and whether it uses tools."""

    def __init__(self, tokenizer: Any, parser_name: str | None = None) -> None:
        self.tokenizer = tokenizer
        self._parser_name = parser_name
        self._uses_tools: bool | None = None  # probed on the first request with tools

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        kw: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
        if tools:
            kw["tools"] = tools
        return _ids(self.tokenizer.apply_chat_template(messages, **kw))

    def template_uses_tools(self) -> bool:
        """Whether the template renders `tools` at all: a template that ignores them renders the
        same prompt with and without a tool."""
        if self._uses_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            try:
                self._uses_tools = self.render(probe, [_PROBE_TOOL]) != self.render(probe, None)
            except Exception:  # noqa: BLE001 - a template that fails on tools does not take them
                self._uses_tools = False
        return self._uses_tools

    def parser(self) -> ToolParser | None:
        if self._parser_name is not None:
            return get_tool_parser(self._parser_name)
        return detect_tool_parser(str(getattr(self.tokenizer, "chat_template", "") or ""))

    def plan(self, body: ChatCompletionRequest) -> tuple[ToolPlan, list[dict[str, Any]] | None]:
        """(the request's tool plan, the tools to render); ToolError when they cannot be
        served: tools on a template without tool support, an unknown format, a named function
        that is not among the tools, tool_choice without tools."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none", "auto"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return ToolPlan(), None
        if choice == "none":
            return ToolPlan(), None
        if not self.template_uses_tools():
            raise ToolError(
                "this model's chat template does not support tools (it renders the same prompt "
                "with and without them); send the request without tools",
                "tools",
            )
        parser = self.parser()
        if parser is None:
            raise ToolError(
                "the tool-call format of this model's chat template is not known; start the "
                f"server with --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))})",
                "tools",
            )
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        forced = None
        if choice == "required":
            forced = self._forced(parser, tools)
        elif choice not in (None, "auto"):
            assert not isinstance(choice, str)
            named = [t for t in tools if t["function"]["name"] == choice.function.name]
            if not named:
                raise ToolError(
                    f"tool_choice names {choice.function.name!r}, which is not among the tools",
                    "tool_choice",
                )
            forced = self._forced(parser, named)
        return ToolPlan(parser, forced, body.parallel_tool_calls is not False), tools

    def _forced(self, parser: ToolParser, tools: list[dict[str, Any]]) -> StructuredOutput:
        added = (
            dict(self.tokenizer.get_added_vocab())
            if hasattr(self.tokenizer, "get_added_vocab")
            else {}
        )
        try:
            return StructuredOutput(grammar=parser.forced_grammar(tools, added.get))
        except ValueError as exc:
            raise ToolError(str(exc), "tools") from exc


def final_message(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason) of a whole answer."""
    if plan.parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = plan.parser.parse(text)
    calls = parsed.calls if plan.parallel else parsed.calls[:1]
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": [
            {
                "id": call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ],
    }
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ChoiceStream:
    """One streamed choice's chat deltas: content, then `tool_calls` deltas as vLLM sends them
    (id, type and name with an empty argument string first, then argument text)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream: ToolStream | None = plan.parser.stream() if plan.parser else None
        self.ids: list[str] = []

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for `text` (empty dict: nothing to send yet)."""
        if self.stream is None:
            return {"content": text} if text else {}
        out: StreamDelta = self.stream.feed(text, final)
        delta: dict[str, Any] = {}
        if out.content:
            delta["content"] = out.content
        calls = []
        for c in out.calls:
            if not self.plan.parallel and c.index > 0:
                continue
            if c.name is not None:
                self.ids.append(call_id())
                calls.append(
                    {
                        "index": c.index,
                        "id": self.ids[c.index],
                        "type": "function",
                        "function": {"name": c.name, "arguments": ""},
                    }
                )
            if c.arguments:
                calls.append({"index": c.index, "function": {"arguments": c.arguments}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        called = self.stream is not None and self.stream.called
        return "tool_calls" if called and reason == "stop" else reason
