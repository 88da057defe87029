"""Tools in chat completions: a request's tools as the format-neutral tool support takes them,
and the OpenAI response shapes of a whole answer or of a stream's deltas.

What `tools`, `tool_choice` and tool messages mean for the prompt and the answer is
moetier/tools/support.py's (shared with LLM.chat); formats are moetier/tools/parsers.py's.
"""

from __future__ import annotations

import uuid
from typing import Any

from moetier.server.protocol import ChatCompletionRequest
from moetier.tools.parsers import StreamDelta, ToolStream
from moetier.tools.support import ToolPlan, ToolSupport


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style dicts (past calls' arguments as the JSON text sent; the
    tool support renders them as the template takes them)."""
    out = []
    for m in body.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls
            ]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        out.append(d)
    return out


def body_plan(
    support: ToolSupport, body: ChatCompletionRequest
) -> tuple[ToolPlan, list[dict[str, Any]] | None]:
    """The request's tool plan and the tools to render (ToolError: answered 400)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    return support.plan(tools, choice, body.parallel_tool_calls is not False)


def final_message(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """(the assistant message, the finish reason) of a whole answer."""
    content, calls = plan.calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    reasoning = plan.reasoning(text)
    if reasoning is not None:
        message["reasoning_content"] = reasoning  # vLLM's name for it
    if not calls:
        return message, finish_reason
    message["content"] = content
    message["tool_calls"] = [c.to_openai(call_id()) for c in calls]
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
        if out.reasoning:
            delta["reasoning_content"] = out.reasoning
        if out.content:
            delta["content"] = out.content
        calls = []
        for c in out.calls:
            if not self.plan.tools or (not self.plan.parallel and c.index > 0):
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
        called = self.stream is not None and self.stream.called and self.plan.tools
        return "tool_calls" if called and reason == "stop" else reason
