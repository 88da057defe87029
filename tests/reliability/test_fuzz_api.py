"""API fuzzing: requests generated from the server's own OpenAPI schema, plus hostile bytes.

Every route in /openapi.json gets schema-shaped bodies (schema_strategy.py), arbitrary JSON,
broken bytes, wrong methods, wrong content types and missing or wrong keys. Held: no 5xx, the
server never dies, every 4xx body is OpenAI-shaped, and afterwards a greedy request answers the
same tokens as the library and the engine's KV and expert-slot integrity checks pass.
MOETIER_FUZZ_EXAMPLES sets the count (CI default 300; scripts/stress.sh runs >= 5,000).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetier import LLM, SamplingParams
from tests.reliability.conftest import StartServer, env_int, record
from tests.reliability.schema_strategy import from_openapi
from tests.server.conftest import DEVICE, LiveServer

KEY = "sk-fuzz-7d1e"
EXAMPLES = env_int("MOETIER_FUZZ_EXAMPLES", 300)
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
STATS: Counter[str] = Counter()

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def server(serve: StartServer, tiny_model: Path) -> LiveServer:
    # A short context keeps each generated request cheap; small queues make 429s reachable.
    return serve(
        tiny_model, "--api-key", KEY, "--max-model-len", "48", "--max-num-seqs", "8",
        "--max-waiting", "8", "--max-body-bytes", "65536", "--expert-budget", "50%",
    )  # fmt: skip


@pytest.fixture(scope="module")
def openapi(server: LiveServer) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/openapi.json", timeout=10)
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


def _body_strategies(openapi: dict[str, Any], model: str) -> dict[str, st.SearchStrategy[Any]]:
    """Per POST route: bodies valid under its schema, half of them naming the served model."""
    out = {}
    for path, ops in openapi["paths"].items():
        body = ops.get("post", {}).get("requestBody")
        if body is None:
            continue
        valid = from_openapi(body["content"]["application/json"]["schema"], openapi["components"])
        named = valid.map(lambda b: {**b, "model": model} if isinstance(b, dict) else b)
        out[path] = st.one_of(valid, named, named, named)
    return out


def _check(r: httpx.Response, method: str, path: str) -> None:
    STATS[f"{r.status_code}"] += 1
    where = f"{method} {path} -> {r.status_code}: {r.text[:300]}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        assert isinstance(err["message"], str) and err["message"], where
        assert isinstance(err["type"], str), where
    elif path.startswith("/v1/") and method == "POST":
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]", where
            for e in events[:-1]:
                assert "error" not in json.loads(e), where
        else:
            assert r.json()["choices"], where


def test_fuzz_every_route(server: LiveServer, openapi: dict[str, Any], tiny_model: Path) -> None:
    paths = sorted(openapi["paths"]) + ["/v1/nothing", "/docs", "/openapi.json/../health"]
    bodies = _body_strategies(openapi, server.model)
    raw = st.one_of(
        JSON.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.just(b"{"),
        st.just(b"x" * 70_000),  # over --max-body-bytes: 413
    )
    http = httpx.Client(base_url=server.url, timeout=60)
    t0 = time.monotonic()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(paths), "path")
        declared = [m.upper() for m in openapi["paths"].get(path, {"get": None})]
        method = data.draw(st.sampled_from(declared * 8 + METHODS), "method")
        auth = data.draw(st.sampled_from(["Bearer " + KEY] * 6 + ["", "Bearer x", KEY]), "auth")
        headers = {"Authorization": auth} if auth else {}
        kind = data.draw(st.sampled_from(["schema"] * 5 + ["raw"]), "kind")
        if kind == "schema" and path in bodies:
            content = json.dumps(data.draw(bodies[path], "body")).encode()
        else:
            content = data.draw(raw, "raw")
        headers["Content-Type"] = data.draw(
            st.sampled_from(["application/json"] * 4 + ["text/plain", ""]), "ctype"
        )
        params = data.draw(st.dictionaries(st.sampled_from(["check", "x"]), st.text(max_size=6)))
        sends_body = method in ("POST", "PUT", "PATCH", "DELETE")
        r = http.request(
            method, path, content=content if sends_body else None, headers=headers, params=params
        )
        _check(r, method, path)

    try:
        one()
    finally:
        http.close()
    elapsed = time.monotonic() - t0
    assert server.proc.poll() is None, "the server process died"

    # Afterwards: a normal request gives the library's greedy tokens; nothing is leaked.
    prompt = [72, 101, 108, 108, 111]
    body = {"model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 200, r.text
    llm = LLM(str(tiny_model), device=DEVICE, dtype="float32", progress=False)
    ref = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert r.json()["choices"][0]["token_ids"] == ref[0].outputs[0].token_ids
    health = _idle(server)
    assert health["kv_blocks_used"] == 0
    record("fuzz", {"requests": sum(STATS.values()), "status": dict(STATS), "seconds": elapsed})


def _idle(server: LiveServer, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        h = server.health()  # /health?check=true: KV and expert-slot integrity
        if h["num_requests_running"] == 0 and h["num_requests_waiting"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


M = "<served>"  # replaced by the served model's name
HOSTILE: list[tuple[str, bytes | dict[str, Any]]] = [
    ("/v1/completions", {"model": M, "prompt": [1, 2], "seed": 2**64, "max_tokens": 2}),
    ("/v1/completions", {"model": M, "prompt": [1, 2], "seed": 2**64 - 1, "n": 2}),
    ("/v1/completions", {"model": M, "prompt": [1, 2], "seed": -(2**63) - 1}),
    ("/v1/completions", {"model": M, "prompt": [2**64, 1], "max_tokens": 2}),
    ("/v1/completions", {"model": M, "prompt": [-1], "max_tokens": 2}),
    ("/v1/completions", {"model": M, "prompt": [[]], "max_tokens": 2}),
    ("/v1/completions", {"model": M, "prompt": "", "max_tokens": 2}),
    ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 10**30}),
    ("/v1/completions", {"model": M, "prompt": "hi", "stop": [""], "max_tokens": 3}),
    ("/v1/completions", {"model": M, "prompt": "hi", "top_k": 10**9, "max_tokens": 3}),
    ("/v1/completions", {"model": M, "prompt": "hi", "temperature": 1e-300, "max_tokens": 3}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "system"}], "top_p": 5e-324}),
    ("/v1/completions", {"model": M, "prompt": "hi", "logprobs": 20, "max_tokens": 3}),
    ("/v1/completions", {"model": M, "prompt": "hi\x00\ufffd\U0001f600", "max_tokens": 3}),
    ("/v1/completions", b'{"model": "' + b"x" * 10 + b'", "prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": 1, "prompt": NaN, "temperature": Infinity}'),
    ("/v1/completions", b'{"temperature": 1e400}'),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/v1/completions", b'{"a": ' * 2000 + b"1" + b"}" * 2000),
    ("/v1/completions", b"\xff\xfe\x00"),
    ("/v1/completions", b""),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": None}]}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": []}]}),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "tool"}], "n": 16,
                              "max_completion_tokens": 1, "logprobs": True, "top_logprobs": 20}),
]  # fmt: skip


@pytest.mark.parametrize("path,body", HOSTILE)
def test_hostile_bodies(server: LiveServer, path: str, body: bytes | dict[str, Any]) -> None:
    if isinstance(body, dict):
        body = {**body, "model": server.model} if body.get("model") == M else body
        content = json.dumps(body).encode()
    else:
        content = body
    r = httpx.post(f"{server.url}{path}", content=content, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})  # fmt: skip
    _check(r, "POST", path)
    assert server.proc.poll() is None
