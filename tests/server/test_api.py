"""The OpenAI API through the official client: shapes, streaming, auth, bad input, metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moetier import LLM, SamplingParams
from tests.server.conftest import API_KEY, DEVICE, LiveServer
from tests.server.tiny import EOS


@pytest.fixture(scope="module")
def server(serve: Callable[..., LiveServer]) -> LiveServer:
    # Half the experts in slots: expert lookups are counted (a fully resident CUDA model may
    # look slots up on the device and skip the counters).
    return serve(
        "--api-key", API_KEY, "--max-num-seqs", "16", "--max-waiting", "16",
        "--expert-budget", "50%",
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(server: LiveServer, tiny_model: Any) -> LLM:
    return LLM(str(tiny_model), device=DEVICE, dtype="float32", progress=False)


def _post(server: LiveServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kw)


def test_models_and_health(client: openai.OpenAI, server: LiveServer) -> None:
    assert [m.id for m in client.models.list()] == [server.model]
    health = server.health()
    assert health["status"] == "ok" and health["kv_blocks_used"] == 0


def test_chat_matches_llm_chat(client: openai.OpenAI, server: LiveServer, llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0.0))
    r = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=10,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert r.usage is not None and r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_stream_shape(client: openai.OpenAI, server: LiveServer, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    ref = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    finals = [f for f in finals if f]
    assert finals == [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_completions_json_and_stream(client: openai.OpenAI, server: LiveServer, llm: LLM) -> None:
    ref = llm.generate("Once upon", SamplingParams(max_tokens=12, temperature=0.0))[0]
    r = client.completions.create(model=server.model, prompt="Once upon", max_tokens=12,
                                  temperature=0)  # fmt: skip
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage is not None and r.usage.total_tokens == len(ref.prompt_token_ids) + len(
        ref.outputs[0].token_ids
    )
    stream = client.completions.create(
        model=server.model, prompt="Once upon", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == ref.outputs[0].text


def test_stream_ends_with_done(server: LiveServer) -> None:
    body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
    lines = [ln for ln in _post(server, "/v1/completions", body).text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


def test_n_seed_stop_and_logprobs(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.completions.create(
        model=server.model, prompt=[1, 2, 3], max_tokens=6, temperature=1.0, n=3, seed=7,
        logprobs=2,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = client.completions.create(
        model=server.model, prompt=[1, 2, 3], max_tokens=6, temperature=1.0, n=3, seed=7
    )
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # seeded
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 6
    # dict form: two byte tokens that both render as U+FFFD share one key
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    text = (
        client.completions.create(
            model=server.model, prompt=[1, 2, 3], max_tokens=16, temperature=0
        )
        .choices[0]
        .text
    )
    stop = text[3:5]
    if stop:
        cut = client.completions.create(
            model=server.model, prompt=[1, 2, 3], max_tokens=16, temperature=0, stop=[stop]
        ).choices[0]
        assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "x"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=1,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3 and len(content[0].top_logprobs) == 1


BAD: list[tuple[str, Any, str | None]] = [
    ("/v1/chat/completions", b"{not json", "invalid_json"),
    ("/v1/chat/completions", {"model": "M", "messages": "hi"}, "invalid_value"),
    (
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "a"}]},
        "model_not_found",
    ),  # fmt: skip
    ("/v1/chat/completions", {"model": "M", "messages": []}, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": [7] * 300}, "context_length_exceeded"),
    (
        "/v1/completions",
        {"model": "M", "prompt": "hi", "max_tokens": 1000},
        "context_length_exceeded",
    ),  # fmt: skip
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": "ten"}, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "temperature": -1}, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "top_p": 0}, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": [999]}, None),
    ("/v1/completions", {"model": "M", "prompt": ""}, None),
    ("/v1/completions", {"model": "M"}, "invalid_value"),
]


@pytest.mark.parametrize("path,body,code", BAD)
def test_bad_input_is_400_and_server_stays_up(
    server: LiveServer, client: openai.OpenAI, path: str, body: Any, code: str | None
) -> None:
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": server.model}
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    ok = client.completions.create(model=server.model, prompt=[1, 2], max_tokens=2)
    assert len(ok.choices) == 1


def test_body_limit_queue_bound_and_unknown_route(server: LiveServer) -> None:
    big = _post(server, "/v1/completions", b"x" * (5 << 20))
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    # 20 prompts x n=2 = 40 engine requests > 16 running + 16 waiting
    many = {"model": server.model, "prompt": [[1, 2]] * 20, "n": 2, "max_tokens": 1}
    busy = _post(server, "/v1/completions", many)
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "rate_limit_exceeded"
    missing = _post(server, "/v1/nothing", {})
    assert missing.status_code == 404 and "error" in missing.json()
    assert server.health()["status"] == "ok"


def test_auth(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Basic {API_KEY}"})
    assert r.status_code == 401
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # not behind the key
    assert API_KEY not in server.log()


def test_public_bind_without_key_is_refused(tiny_model: Any) -> None:
    cmd = [sys.executable, "-m", "moetier", "serve", str(tiny_model), "--host", "0.0.0.0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--api-key" in out.stderr and "--allow-public-without-key" in out.stderr


def test_no_code_routes(server: LiveServer) -> None:
    paths = {r for r in httpx.get(f"{server.url}/openapi.json").json()["paths"]}
    assert paths == {
        "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"
    }  # fmt: skip


def _metrics(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model_name") == server.model:
                key = s.name + "".join(
                    f",{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                out[key] = s.value
    return out


def test_metrics_parse_and_move(server: LiveServer, client: openai.OpenAI) -> None:
    before = _metrics(server)
    client.completions.create(model=server.model, prompt=[4, 5, 6], max_tokens=5,
                              temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    server.health()  # fresh engine counters
    after = _metrics(server)
    for name in (
        "moetier:time_to_first_token_seconds_count",
        "moetier:e2e_request_latency_seconds_count",
        "moetier:request_success_total,finished_reason=length",
    ):
        assert after[name] == before.get(name, 0.0) + 1, name
    assert (
        after["moetier:inter_token_latency_seconds_count"]
        >= before.get("moetier:inter_token_latency_seconds_count", 0.0) + 4
    )
    assert (
        after["moetier:generation_tokens_total"]
        >= before.get("moetier:generation_tokens_total", 0) + 5
    )
    assert after["moetier:expert_lookups_total"] > before.get("moetier:expert_lookups_total", 0)
    assert after["moetier:kv_cache_blocks_used"] == 0 and after["moetier:kv_cache_blocks_free"] > 0
    # the default KV format is the model dtype (the server runs float32)
    assert after["moetier:kv_cache_info,kv_cache_dtype=fp32"] == 1.0
    assert after["moetier:kv_cache_bytes_per_token"] > 0
    # experts stored dense in the model dtype: one packed expert's bytes as the value
    assert after["moetier:expert_format_info,expert_format=fp32"] > 0
    for name in ("moetier:num_requests_running", "moetier:num_requests_waiting",
                 "moetier:num_preemptions_total", "moetier:expert_hits_total,tier=device",
                 "moetier:expert_bytes_total,path=host_to_device",
                 "moetier:expert_exposed_fetch_seconds_total"):  # fmt: skip
        assert name in after, name
    assert EOS > 0
