"""usage.prompt_tokens_details.cached_tokens: the prompt tokens the engine reused from the KV
prefix cache at admission, exact on a live tiny server (block size 16, the last prompt token is
always computed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer

_BLOCK = 16


@pytest.fixture(scope="module")
def server(serve: Callable[..., LiveServer]) -> LiveServer:
    return serve("--kv-block-size", str(_BLOCK))


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _reused(prompt_len: int) -> int:
    return (prompt_len - 1) // _BLOCK * _BLOCK


def test_completions_report_cached_tokens(server: LiveServer) -> None:
    prompt = [(7 * i + 3) % 256 for i in range(41)]
    body = {"model": server.model, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = _post(server, "/v1/completions", body).json()["usage"]
    assert first["prompt_tokens"] == 41
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = _post(server, "/v1/completions", body).json()["usage"]
    assert (
        second["prompt_tokens_details"] == {"cached_tokens": _reused(41)} == {"cached_tokens": 32}
    )
    # a prompt that extends the first by one block reuses its full blocks, no more
    longer = {**body, "prompt": prompt + list(range(20))}
    third = _post(server, "/v1/completions", longer).json()["usage"]
    assert third["prompt_tokens_details"]["cached_tokens"] == 32


def test_chat_reports_cached_tokens_streamed_and_whole(
    server: LiveServer, tiny_model: Path
) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Tell me about caching prefixes of prompts."}]
    ids = AutoTokenizer.from_pretrained(str(tiny_model)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    n = len(ids if isinstance(ids, list) else ids["input_ids"])
    body = {"model": server.model, "messages": messages, "max_tokens": 3, "temperature": 0}
    first = _post(server, "/v1/chat/completions", body).json()["usage"]
    assert first["prompt_tokens"] == n and first["prompt_tokens_details"]["cached_tokens"] == 0
    whole = _post(server, "/v1/chat/completions", body).json()["usage"]
    assert whole["prompt_tokens_details"]["cached_tokens"] == _reused(n) > 0
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    lines = _post(server, "/v1/chat/completions", stream).text.splitlines()
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == _reused(n)
