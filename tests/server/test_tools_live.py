"""Tools and structured output through the official client against a live server on a tiny
random checkpoint whose template takes tools (the demo's): the grammar alone makes its answers
valid, and the server's constrained tokens equal the library's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from moetier import LLM, SamplingParams, StructuredOutput
from moetier.demo.chat_template import CHAT_TEMPLATE
from tests.server.conftest import DEVICE, LiveServer, start_server, stop_server
from tests.server.schemas import MESSAGES, PARAMS, TOOLS, random_schemas
from tests.server.tiny import make_tiny_server_model


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tools") / "tiny-tools"
    return make_tiny_server_model(path, max_position_embeddings=2048, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(tools_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tools_model, tmp_path_factory.mktemp("log") / "server.log")
    yield live
    assert stop_server(live) == 0


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _valid_call(name: str, arguments: str) -> None:
    assert name in PARAMS
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_required_tool_choice_returns_a_valid_call(
    client: openai.OpenAI, server: LiveServer
) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
            max_tokens=120, temperature=1.0, seed=seed,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        _valid_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streams_the_same_call(client: openai.OpenAI, server: LiveServer) -> None:
    kw: dict[str, Any] = dict(
        model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0,
        seed=11, tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert whole is not None and whole[0].function.name == "get_time"
    _valid_call("get_time", whole[0].function.arguments)
    name, args, reasons = None, "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            if tc.function and tc.function.name:
                assert name is None and tc.id and tc.id.startswith("call_")
                name = tc.function.name
            args += (tc.function.arguments or "") if tc.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert (name, args) == ("get_time", whole[0].function.arguments)
    assert [r for r in reasons if r] == ["tool_calls"]


def test_json_schema_answers_validate(client: openai.OpenAI, server: LiveServer) -> None:
    for i, schema in enumerate(random_schemas(4, seed=1)):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": schema, "strict": True},
        }
        r = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "JSON please"}],
            response_format=fmt, max_tokens=200, temperature=1.0, seed=i,  # type: ignore[arg-type]
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)


def test_server_and_library_constrain_alike(
    client: openai.OpenAI, server: LiveServer, tools_model: Path
) -> None:
    schema = random_schemas(1, seed=5)[0]
    prompt = [104, 105, 32]
    r = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=150, temperature=1.0, seed=3,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "r", "schema": schema}},
                    "return_token_ids": True},
    )  # fmt: skip
    llm = LLM(str(tools_model), device=DEVICE, dtype="float32", progress=False)
    params = SamplingParams(
        max_tokens=150, temperature=1.0, seed=3, structured=StructuredOutput(json=schema)
    )
    out = llm.generate([prompt], params)[0].outputs[0]
    assert r.choices[0].text == out.text
    assert r.choices[0].token_ids == out.token_ids  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(out.text), schema)


@pytest.fixture(scope="module")
def llm(tools_model: Path) -> LLM:
    return LLM(str(tools_model), device=DEVICE, dtype="float32", progress=False)


def test_llm_chat_tools_match_the_server(
    client: openai.OpenAI, server: LiveServer, llm: LLM
) -> None:
    """LLM.chat(tools=, tool_choice=) renders, forces and parses as the server does: the same
    seed gives the same call, whose arguments validate."""
    for seed, choice in (
        (0, "required"),
        (5, {"type": "function", "function": {"name": "get_time"}}),
    ):
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed)
        out = llm.chat(MESSAGES, params, tools=TOOLS, tool_choice=choice).outputs[0]
        (call,) = out.tool_calls
        _valid_call(call.name, call.arguments)
        assert out.content is None and out.finish_reason == "stop"
        r = client.chat.completions.create(
            model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=120, temperature=1.0, seed=seed,
        )  # fmt: skip
        (served,) = r.choices[0].message.tool_calls or []
        assert (served.function.name, served.function.arguments) == (call.name, call.arguments)
        if not isinstance(choice, str):
            assert call.name == "get_time"
    # a past call and its result render as the server renders them; "none" answers in text
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    reply = llm.chat(history, SamplingParams(max_tokens=4, seed=1), tools=TOOLS, tool_choice="none")
    (out,) = reply.outputs
    assert out.tool_calls == [] and out.content == out.text
    assert "<tool_call>" in llm.tokenizer.decode(reply.prompt_token_ids)
    r = client.chat.completions.create(
        model=server.model, messages=history, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
        max_tokens=4, temperature=1.0, seed=1,
    )  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens == len(reply.prompt_token_ids)
    assert r.choices[0].message.content == out.text
    # the same conversation again reuses its full KV blocks (16 tokens each, the last token
    # always computed), as RequestOutput.num_cached_tokens says
    again = llm.chat(history, SamplingParams(max_tokens=4, seed=1), tools=TOOLS, tool_choice="none")
    n = len(again.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == out.token_ids


def test_llm_chat_tool_errors(llm: LLM) -> None:
    from moetier.errors import ConfigError

    with pytest.raises(ConfigError, match="tool_choice needs tools"):
        llm.chat(MESSAGES, tool_choice="required")
    with pytest.raises(ConfigError, match="not among the tools"):
        llm.chat(MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(ConfigError, match=r"tools\[0\] must be"):
        llm.chat(MESSAGES, tools=[{"name": "get_time"}])
    with pytest.raises(ConfigError, match="unknown tool-call format"):
        llm.chat(MESSAGES, tools=TOOLS, tool_parser="nope")
    with pytest.raises(ConfigError, match="cannot be combined with a forced tool call"):
        structured = SamplingParams(structured=StructuredOutput(json_object=True))
        llm.chat(MESSAGES, structured, tools=TOOLS, tool_choice="required")
