"""DeepSeek and harmony (gpt-oss) tool calls through the server, in process with a scripted
engine: the format picked by the checkpoint's model_type or template, whole and streamed answers,
and what reaches the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.server.test_tools_inprocess import WEATHER, _app, _chat
from tests.server.tiny import save_byte_tokenizer

# Template-rendered markers make the templates take tools; they name no format by themselves.
HARMONYISH = (
    "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|channel|>final<|message|>"
    "{{ m['content'] }}<|end|>{% endfor %}<|start|>assistant"
)
DSISH = (
    "{% if tools %}## Tools {{ tools | tojson }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
)
CALL = (
    "<|channel|>analysis<|message|>Weather tool.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
FINAL = (
    "<|channel|>analysis<|message|>Say hi.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
)
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_CALL = f'Ok.{B}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{CE}{E}'


def _tokenizer(path: Path, template: str, model_type: str | None) -> Any:
    from transformers import AutoTokenizer

    save_byte_tokenizer(path, template)
    if model_type is not None:
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {
        "oss": _tokenizer(tmp_path_factory.mktemp("oss"), HARMONYISH, "gpt_oss"),
        "ds": _tokenizer(tmp_path_factory.mktemp("ds"), DSISH, "deepseek_v3"),
        "other": _tokenizer(tmp_path_factory.mktemp("other"), DSISH, "mixtral"),
    }


def _pieces(text: str, size: int = 9) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _stream_deltas(http: Any, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    text = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    chunks = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    return [c["delta"] for c in choices], [c["finish_reason"] for c in choices]


def test_harmony_call_whole_and_streamed(toks: dict[str, Any]) -> None:
    http, engine = _app(toks["oss"], _pieces(CALL))
    r = http.post("/v1/chat/completions", json=_chat(tools=[WEATHER]))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert engine.sent[0][1].skip_special_tokens is False  # the channel markers are kept
    deltas, reasons = _stream_deltas(http, _chat(tools=[WEATHER]))
    assert all(not d.get("content") for d in deltas)  # reasoning is not content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather tool."
    assert choice["message"]["reasoning_content"] == "Weather tool."
    names = [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", [])
             if tc["function"].get("name")]  # fmt: skip
    args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
    assert (names, args, reasons[-1]) == (["get_weather"], '{"city": "Paris"}', "tool_calls")


def test_harmony_content_without_tools(toks: dict[str, Any]) -> None:
    http, engine = _app(toks["oss"], _pieces(FINAL, 5))
    r = http.post("/v1/chat/completions", json=_chat())
    assert r.json()["choices"][0]["message"] == {
        "role": "assistant", "content": "Hi!", "reasoning_content": "Say hi."
    }  # fmt: skip
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    deltas, reasons = _stream_deltas(http, _chat())
    assert "".join(d.get("content", "") for d in deltas) == "Hi!" and reasons[-1] == "stop"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Say hi."
    first = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first:])  # reasoning came first
    assert all(p.skip_special_tokens is False for _, p in engine.sent)
    # a call it was not offered stays out of the answer
    http, _ = _app(toks["oss"], [CALL])
    r = http.post("/v1/chat/completions", json=_chat(tools=[WEATHER], tool_choice="none"))
    assert r.json()["choices"][0]["message"] == {
        "role": "assistant", "content": "", "reasoning_content": "Weather tool."
    }  # fmt: skip
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_harmony_forced_call_grammar(toks: dict[str, Any]) -> None:
    http, engine = _app(toks["oss"], [CALL])
    r = http.post("/v1/chat/completions", json=_chat(tools=[WEATHER], tool_choice="required"))
    assert r.status_code == 200, r.text
    grammar = engine.sent[0][1].structured.grammar
    assert grammar.startswith('start: "<|channel|>" (call_0)\ncall_0: "commentary to=functions.')


def test_deepseek_by_model_type(toks: dict[str, Any]) -> None:
    http, engine = _app(toks["ds"], _pieces(DS_CALL, 4))
    r = http.post("/v1/chat/completions", json=_chat(tools=[WEATHER]))
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Ok."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert engine.sent[0][1].skip_special_tokens is False
    deltas, reasons = _stream_deltas(http, _chat(tools=[WEATHER]))
    assert "".join(d.get("content", "") for d in deltas) == "Ok." and reasons[-1] == "tool_calls"
    http.post("/v1/chat/completions", json=_chat(tools=[WEATHER], tool_choice="required"))
    assert engine.sent[-1][1].structured.grammar.startswith(
        f"start: {json.dumps(B)} (call_0) {json.dumps(E)}"
    )
    # the same template on a family without a known format: refused, naming the option
    http, _ = _app(toks["other"])
    r = http.post("/v1/chat/completions", json=_chat(tools=[WEATHER]))
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
