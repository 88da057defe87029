"""Tools and response_format in process, with a scripted engine that replays a model's text:
the OpenAI response shapes (whole and streamed), what reaches the engine, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from moetier.core import StructuredOutput
from moetier.demo.chat_template import CHAT_TEMPLATE
from moetier.engine.outputs import RequestDelta
from moetier.metrics import ServerMetrics
from moetier.server.app import ServerSettings, create_app
from tests.server.test_errors_inprocess import ScriptedClient
from tests.server.tiny import save_byte_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PIECES = [
    "Sure.",
    "<tool_",
    'call>\n{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}\n</tool_call>',
]


# A Mistral-like template: tools in [AVAILABLE_TOOLS], calls after [TOOL_CALLS]
MISTRALISH = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m['tool_calls'] %}[TOOL_CALLS]{{ m['tool_calls'] | tojson }}</s>"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)


class ReplayClient(ScriptedClient):
    """Answers every request with PIECES, one delta each, then stops; keeps what it was sent."""

    info = {"model": "m", "max_model_len": 4096, "vocab_size": 259, "kv_tokens": 8192}

    def __init__(self, pieces: list[str]) -> None:
        super().__init__()
        self.pieces = pieces
        self.sent: list[tuple[list[int], Any]] = []

    def submit(self, rid: int, ids: list[int], params: Any, out: Any, index: int,
               logprobs: int | None = None) -> None:  # fmt: skip
        self.sent.append((ids, params))
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            delta = RequestDelta(rid, [65], piece, last, "stop" if last else None,
                                 num_output_tokens=i + 1)  # fmt: skip
            out.put_nowait((index, delta))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    out = {}
    for name, template in (("tools", CHAT_TEMPLATE), ("plain", None), ("mistral", MISTRALISH)):
        path: Path = tmp_path_factory.mktemp(name)
        if template is None:
            save_byte_tokenizer(path)
        else:
            save_byte_tokenizer(path, template)
        out[name] = AutoTokenizer.from_pretrained(str(path))
    return out


def _app(tokenizer: Any, pieces: list[str] = PIECES) -> tuple[TestClient, ReplayClient]:
    client = ReplayClient(pieces)
    app = create_app(client, tokenizer, ServerSettings("m"), ServerMetrics("m"))  # type: ignore[arg-type]
    return TestClient(app), client


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **kw}


def test_tool_call_answer_shape(tokenizers: dict[str, Any]) -> None:
    assert "".join(PIECES).startswith("Sure.<tool_call>\n")
    http, engine = _app(tokenizers["tools"])
    r = http.post("/v1/chat/completions", json=_chat(tools=[WEATHER]))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Sure."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ids, params = engine.sent[0]
    assert params.structured is None  # auto: the model may answer in text
    prompt = tokenizers["tools"].decode(ids)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt


def test_tool_call_stream_deltas(tokenizers: dict[str, Any]) -> None:
    http, _ = _app(tokenizers["tools"])
    text = http.post("/v1/chat/completions", json=_chat(tools=[WEATHER], stream=True)).text
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln)["choices"][0] for ln in lines[:-1]]
    deltas = [c["delta"] for c in chunks]
    call_id = deltas[2]["tool_calls"][0]["id"]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "Sure."},
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}},
                        {"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]  # fmt: skip
    assert [c["finish_reason"] for c in chunks] == [None, None, None, "tool_calls"]


def test_parallel_tool_calls_false_keeps_the_first(tokenizers: dict[str, Any]) -> None:
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>\n'
    http, _ = _app(tokenizers["tools"], [block % "Paris", block % "Rome"])
    for parallel, names in ((True, ["Paris", "Rome"]), (False, ["Paris"])):
        body = _chat(tools=[WEATHER], parallel_tool_calls=parallel)
        calls = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert [
            json.loads(c["function"]["arguments"])["city"] for c in calls["tool_calls"]
        ] == names
        text = http.post("/v1/chat/completions", json={**body, "stream": True}).text
        chunks = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
        indexes = {
            tc["index"] for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])
        }
        assert indexes == set(range(len(names)))


def test_required_and_named_choice_force_a_call_by_grammar(tokenizers: dict[str, Any]) -> None:
    other = {"type": "function", "function": {"name": "get_time"}}
    http, engine = _app(tokenizers["tools"])
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = http.post(
            "/v1/chat/completions", json=_chat(tools=[WEATHER, other], tool_choice=choice)
        )
        assert r.status_code == 200, r.text
    required, named = (p.structured for _, p in engine.sent)
    assert isinstance(required, StructuredOutput) and required.grammar is not None
    assert (
        '"const": "get_weather"' in required.grammar and '"const": "get_time"' in required.grammar
    )
    assert named.grammar is not None and '"get_weather"' not in named.grammar


def test_mistral_format_keeps_special_tokens(tokenizers: dict[str, Any]) -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    http, engine = _app(tokenizers["mistral"], [text[:20], text[20:]])
    r = http.post("/v1/chat/completions", json=_chat(tools=[WEATHER]))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    http.post("/v1/chat/completions", json=_chat(tools=[WEATHER], tool_choice="required"))
    (_, auto), (_, required) = engine.sent
    assert auto.skip_special_tokens is False and auto.structured is None
    assert required.structured.grammar.startswith('start: "[TOOL_CALLS]" "["')
    http.post("/v1/chat/completions", json=_chat())
    assert engine.sent[-1][1].skip_special_tokens is True  # no tools: specials stay hidden


def test_history_with_calls_and_results_renders(tokenizers: dict[str, Any]) -> None:
    http, engine = _app(tokenizers["tools"], ["It is sunny."])
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = http.post(
        "/v1/chat/completions", json={"model": "m", "messages": messages, "tools": [WEATHER]}
    )
    assert r.json()["choices"][0] == {
        "index": 0, "logprobs": None, "finish_reason": "stop",
        "message": {"role": "assistant", "content": "It is sunny."},
    }  # fmt: skip
    prompt = tokenizers["tools"].decode(engine.sent[0][0])
    assert prompt.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_response_format_reaches_the_engine(tokenizers: dict[str, Any]) -> None:
    http, engine = _app(tokenizers["plain"], ['{"a": 1}'])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = http.post("/v1/chat/completions", json=_chat(response_format=fmt))
    assert r.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    r = http.post("/v1/completions", json={"model": "m", "prompt": "x",
                                           "response_format": {"type": "json_object"}})  # fmt: skip
    assert r.status_code == 200
    r = http.post("/v1/chat/completions", json=_chat(response_format={"type": "text"}))
    assert r.status_code == 200
    got = [p.structured for _, p in engine.sent]
    assert got == [StructuredOutput(json=schema), StructuredOutput(json_object=True), None]


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("plain", _chat(tools=[WEATHER]), "tools", "unsupported"),
    ("tools", _chat(tool_choice="required"), "tool_choice", "unsupported"),
    (
        "tools",
        _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
        "unsupported",
    ),  # fmt: skip
    (
        "tools",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "frob"}}},
                },
            }
        ),
        "response_format",
        "invalid_schema",
    ),  # fmt: skip
    ("tools", _chat(response_format={"type": "json_schema"}), "response_format.json_schema", None),
    (
        "tools",
        _chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
        None,
    ),  # fmt: skip
    (
        "tools",
        _chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "frob"}}},
                    },
                }
            ],
            tool_choice="required",
        ),
        "tool_choice",
        "invalid_schema",
    ),  # fmt: skip
    ("tools", _chat(presence_penalty=0.5), "presence_penalty", "unsupported_field"),
    ("tools", _chat(logit_bias={"5": 10}), "logit_bias", "unsupported_field"),
    ("tools", _chat(functions=[{"name": "f"}]), "functions", "unsupported_field"),
    ("tools", {"model": "m", "prompt": "x", "best_of": 3}, "best_of", "unsupported_field"),
]


@pytest.mark.parametrize("tok,body,param,code", REFUSED)
def test_refusals_are_400(
    tokenizers: dict[str, Any], tok: str, body: dict[str, Any], param: str, code: str | None
) -> None:
    http, engine = _app(tokenizers[tok])
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    if code is not None:
        assert err["code"] == code
    assert engine.sent == []


def test_defaults_of_unimplemented_fields_and_unknown_fields_pass(
    tokenizers: dict[str, Any],
) -> None:
    http, _ = _app(tokenizers["plain"], ["ok"])
    body = _chat(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="u",
                 some_future_field=1, tool_choice="none")  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
