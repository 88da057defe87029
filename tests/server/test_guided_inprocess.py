"""guided_choice / guided_regex on both endpoints, in process with a scripted engine: what
reaches the engine, and each refusal as an OpenAI-shaped 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from moetier.core import StructuredOutput
from tests.server.test_tools_inprocess import WEATHER, _app, _chat, tokenizers

__all__ = ["tokenizers"]  # the fixture, shared


def test_guided_fields_reach_the_engine(tokenizers: dict[str, Any]) -> None:
    http, engine = _app(tokenizers["plain"], ["yes"])
    r = http.post("/v1/chat/completions", json=_chat(guided_choice=["yes", "no"]))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "yes"
    r = http.post("/v1/completions", json={"model": "m", "prompt": "x", "guided_regex": "[a-z]+"})
    assert r.status_code == 200, r.text
    r = http.post(
        "/v1/completions", json={"model": "m", "prompt": "x", "guided_choice": ['a"b', "é"]}
    )
    assert r.status_code == 200, r.text
    # explicit nulls ask for nothing
    r = http.post("/v1/chat/completions", json=_chat(guided_choice=None, guided_regex=None))
    assert r.status_code == 200, r.text
    assert [p.structured for _, p in engine.sent] == [
        StructuredOutput(choice=["yes", "no"]),
        StructuredOutput(regex="[a-z]+"),
        StructuredOutput(choice=['a"b', "é"]),
        None,
    ]


REFUSED: list[tuple[dict[str, Any], str, str | None, str]] = [
    (
        _chat(guided_regex="[a-z"),
        "guided_regex",
        "invalid_regex",
        "guided_regex: unsupported regex",
    ),
    (
        {"model": "m", "prompt": "x", "guided_regex": "(ab"},
        "guided_regex",
        "invalid_regex",
        "guided_regex",
    ),
    (_chat(guided_choice=["a"], guided_regex="a"), "guided_regex", None, "cannot be combined"),
    (
        _chat(response_format={"type": "json_object"}, guided_choice=["a"]),
        "guided_choice",
        None,
        "response_format and guided_choice cannot be combined",
    ),
    (
        _chat(tools=[WEATHER], tool_choice="required", guided_regex="a+"),
        "guided_regex",
        None,
        "forced tool call",
    ),
    (_chat(guided_choice=[]), "guided_choice", None, ""),
    (_chat(guided_choice="yes"), "guided_choice", None, ""),
    (_chat(guided_json={"type": "object"}), "guided_json", "unsupported_field", ""),
]


@pytest.mark.parametrize("body,param,code,message", REFUSED)
def test_guided_refusals_are_400(
    tokenizers: dict[str, Any], body: dict[str, Any], param: str, code: str | None, message: str
) -> None:
    http, engine = _app(tokenizers["tools"])
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert message in err["message"]
    if code is not None:
        assert err["code"] == code
    assert engine.sent == []
