"""What a conversation's `tools` and `tool_choice` mean for the prompt and for the answer.

Owns, per tokenizer: the conversation rendered by the model's own chat template (`tools=` as
transformers passes them), whether that template knows tools at all, the tool-call format, the
grammar that forces a call (tool_choice required or a named function), and the calls parsed
from a whole answer. Plain dicts in (OpenAI function tools, messages), plain data out; the
OpenAI response shapes are the server's (server/tools.py), formats are parsers.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetier.core import StructuredOutput, ToolCall
from moetier.tools.parsers import ToolParser, detect_tool_parser, get_tool_parser, tool_parsers

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "moetier_probe",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
_CHOICES = ("none", "auto", "required")
# The format of a family whose chat template names none the parsers detect (config.json's
# model_type -> parser); a template that does name one wins, --tool-call-parser over both.
MODEL_TYPE_PARSERS: dict[str, str] = {
    "deepseek_v2": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "harmony",
}


class ToolError(ValueError):
    """A request's tools cannot be served as asked (the server answers 400 naming `param`)."""

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
    tools: bool = True  # False: the format only reads the content (harmony without tools)

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the first call, the calls) of a whole answer; (the content, []) when
        the model made no well-formed call: the text itself, or for a channelled format
        (harmony) what it shows; (text, []) without a format."""
        if self.parser is None:
            return text, []
        parsed = self.parser.parse(text)
        calls = parsed.calls if self.tools else []
        calls = calls if self.parallel else calls[:1]
        return (parsed.content, calls) if calls else (parsed.content or "", [])

    def reasoning(self, text: str) -> str | None:
        """The reasoning the format sets apart in a whole answer (None: none)."""
        return (self.parser.reasoning(text, True) or None) if self.parser is not None else None


def template_arguments(text: str) -> Any:
    """Arguments of a past call as templates expect them: a dict when the text is JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_messages(
    messages: list[dict[str, Any]], as_text: bool = False
) -> list[dict[str, Any]]:
    """OpenAI-style messages as chat templates take them: past calls' JSON-text arguments as
    dicts, or (`as_text`, templates that concatenate them) dict arguments as JSON text; the
    messages themselves are not changed."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            m = {**m, "tool_calls": [_template_call(c, as_text) for c in calls]}
        out.append(m)
    return out


def _template_call(call: Any, as_text: bool) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call
    args = fn.get("arguments")
    if as_text and not isinstance(args, str) and args is not None:
        args = json.dumps(args, ensure_ascii=False)
    elif not as_text and isinstance(args, str):
        args = template_arguments(args)
    else:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def checkpoint_model_type(tokenizer: Any) -> str | None:
    """config.json's model_type in the directory the tokenizer was loaded from, if any."""
    where = getattr(tokenizer, "name_or_path", None)
    if not where:
        return None
    try:
        config = json.loads((Path(str(where)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    kind = config.get("model_type") if isinstance(config, dict) else None
    return kind if isinstance(kind, str) else None


def _ids(rendered: Any) -> list[int]:
    if not isinstance(rendered, list):
        rendered = list(rendered["input_ids"])
    return [int(t) for t in rendered]


def check_tools(tools: list[Any]) -> None:
    """ToolError unless every tool is an OpenAI function tool with a name."""
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type") != "function" or not fn.get("name"):
            raise ToolError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                f"'parameters': {{...}}}}}}, got {t!r}",
                "tools",
            )


def named_function(choice: Any) -> str:
    """The function a tool_choice object names; ToolError for anything else."""
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise ToolError(
            f"tool_choice must be one of {', '.join(_CHOICES)} or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
            "tool_choice",
        )
    return name


class ToolSupport:
    """Per tokenizer: its chat template, its tool format, and whether it uses tools."""

    def __init__(
        self, tokenizer: Any, parser_name: str | None = None, model_type: str | None = None
    ) -> None:
        """`parser_name`: the format, else the template's, else the family's (`model_type`,
        read from the tokenizer's checkpoint directory when not given)."""
        self.tokenizer = tokenizer
        self._parser_name = parser_name
        self.model_type = model_type if model_type is not None else checkpoint_model_type(tokenizer)
        self._uses_tools: bool | None = None  # probed on the first request with tools

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Token ids of the conversation (past calls' arguments as the template takes them)."""
        kw: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
        if tools:
            kw["tools"] = tools
        parser = self.parser() if self._has_template() else None
        messages = template_messages(messages, parser is not None and parser.text_arguments)
        return _ids(self.tokenizer.apply_chat_template(messages, **kw))

    def _has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

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
        found = detect_tool_parser(str(getattr(self.tokenizer, "chat_template", "") or ""))
        if found is None and self.model_type in MODEL_TYPE_PARSERS:
            return get_tool_parser(MODEL_TYPE_PARSERS[self.model_type])
        return found

    def _content_plan(self) -> ToolPlan:
        """The plan without tools: a channelled format still reads the content out."""
        parser = self.parser() if self._has_template() else None
        return (
            ToolPlan(parser, tools=False) if parser is not None and parser.channels else ToolPlan()
        )

    def plan(
        self, tools: list[dict[str, Any]] | None, choice: Any, parallel: bool = True
    ) -> tuple[ToolPlan, list[dict[str, Any]] | None]:
        """(the request's tool plan, the tools to render) for OpenAI function tools and a
        tool_choice ("none", "auto", "required", a named-function dict, or None: auto);
        ToolError when they cannot be served: tools on a template without tool support, an
        unknown format, a named function that is not among the tools, tool_choice without
        tools."""
        if isinstance(choice, str) and choice not in _CHOICES:
            named_function(choice)  # raises, naming the choices
        if not tools:
            if choice not in (None, "none", "auto"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return self._content_plan(), None
        check_tools(tools)
        if choice == "none":
            return self._content_plan(), None
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
                f"server with --tool-call-parser ({', '.join(sorted(tool_parsers()))})",
                "tools",
            )
        forced = None
        if choice == "required":
            forced = self._forced(parser, tools)
        elif choice not in (None, "auto"):
            name = named_function(choice)
            named = [t for t in tools if t["function"]["name"] == name]
            if not named:
                raise ToolError(
                    f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
                )
            forced = self._forced(parser, named)
        return ToolPlan(parser, forced, parallel), tools

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
