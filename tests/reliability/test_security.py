"""Security: loopback default, no public bind without a key, constant-time key check, size and
token limits, no route that runs or reloads code, and the key never in logs or answers."""

from __future__ import annotations

import hmac
import inspect
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from moetier.cli import build_parser
from moetier.errors import ConfigError
from moetier.metrics import ServerMetrics
from moetier.server import app as app_module
from moetier.server import cli as server_cli
from moetier.server.app import ServerSettings, create_app
from tests.server.conftest import LiveServer, free_port, stop_server, wait_until_up
from tests.server.test_errors_inprocess import ScriptedClient

KEY = "sk-secret-5b0c2e9d41"
ALLOWED = {
    ("/health", "GET"),
    ("/metrics", "GET"),
    ("/v1/models", "GET"),
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/openapi.json", "GET"),
    ("/openapi.json", "HEAD"),
}


def _app(**settings: Any) -> TestClient:
    s = ServerSettings("m", api_key=KEY, **settings)
    return TestClient(create_app(ScriptedClient(), None, s, ServerMetrics("m")))  # type: ignore[arg-type]


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_loopback_is_the_default() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and server_cli.is_loopback(args.host)
    for host in ("127.0.0.1", "127.9.9.9", "::1", "localhost"):
        assert server_cli.is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "192.168.1.5", "example.com", ""):
        assert not server_cli.is_loopback(host), host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "myhost.example.com"])
def test_public_bind_without_key_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="refusing to serve on .* without an API key"):
        server_cli.check_bind(host, None, False)
    with pytest.raises(ConfigError, match="--api-key"):
        server_cli.check_bind(host, "", False)
    server_cli.check_bind(host, KEY, False)  # with a key
    server_cli.check_bind(host, None, True)  # knowingly public
    server_cli.check_bind("127.0.0.1", None, False)


def test_key_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    http = _app()
    assert http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert http.get("/v1/models", headers=_auth()).status_code == 200
    assert calls == [(b"nope", KEY.encode()), (KEY.encode(), KEY.encode())]
    src = inspect.getsource(app_module.BearerAuth)
    assert "== self._key" not in src and "self._key ==" not in src


def test_request_size_limit_with_and_without_content_length() -> None:
    http = _app(max_body_bytes=1024)
    r = http.post("/v1/completions", content=b"x" * 2048, headers=_auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Any:  # no Content-Length: counted while read
        for _ in range(8):
            yield b"y" * 200

    r = http.post("/v1/completions", content=chunks(), headers=_auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.post("/v1/completions", content=b"{}", headers={**_auth(), "Content-Length": "-1"})
    assert r.status_code in (400, 413)


@pytest.mark.parametrize(
    "body,param,phrase",
    [
        ({"prompt": list(range(64))}, "prompt", "the context is 64 tokens"),
        ({"prompt": [1, 2], "max_tokens": 63}, "max_tokens", "ask for at most 62"),
        ({"prompt": [1, 2], "max_tokens": 10**12}, "max_tokens", "exceeds the context"),
        ({"prompt": [1, 2], "n": 17}, "n", "less than or equal to 16"),
        ({"prompt": [[1]] * 600, "max_tokens": 1}, None, "server busy"),
        ({"prompt": [1, 2], "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ],
)
def test_token_limits(body: dict[str, Any], param: str | None, phrase: str) -> None:
    r = _app(max_num_seqs=64, max_waiting=256).post(
        "/v1/completions", json={"model": "m", **body}, headers=_auth()
    )
    err = r.json()["error"]
    assert r.status_code in (400, 429) and phrase in err["message"], err
    assert err["param"] == param


def test_no_route_runs_or_reloads_code() -> None:
    app = create_app(ScriptedClient(), None, ServerSettings("m"), ServerMetrics("m"))  # type: ignore[arg-type]
    routes = set()
    for route in app.routes:
        path = getattr(route, "path", None)
        methods = getattr(route, "methods", None) or {"*"}
        routes |= {(path, m) for m in methods}
        if isinstance(route, APIRoute):
            assert route.endpoint.__module__ == "moetier.server.app", route.endpoint
    assert routes == ALLOWED, routes ^ ALLOWED
    assert app.docs_url is None and app.redoc_url is None
    src = inspect.getsource(server_cli.cmd_serve)
    assert "reload" not in src and "exec(" not in src and "eval(" not in src


def _start_verbose(model: Path, log_path: Path) -> LiveServer:
    """`moetier -v serve` (INFO logs) with the key from the environment."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "MOETIER_API_KEY": KEY}
    cmd = [sys.executable, "-m", "moetier", "-v", "serve", str(model), "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "64"]  # fmt: skip
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    return wait_until_up(LiveServer(f"http://127.0.0.1:{port}", model.name, proc, log_path))


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet sent: picks the outgoing interface
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_key_never_in_logs_or_answers(tiny_model: Path, tmp_path: Path) -> None:
    server = _start_verbose(tiny_model, tmp_path / "server.log")
    answers: list[str] = []
    try:
        url = f"{server.url}/v1/completions"
        ok = {"model": server.model, "prompt": "hi", "max_tokens": 3}
        for headers, body in [
            (_auth(), ok),
            ({"Authorization": f"Bearer {KEY}x"}, ok),  # near miss
            ({"Authorization": f"Basic {KEY}"}, ok),
            (_auth(), {**ok, "model": KEY}),  # the key as a field value
            (_auth(), {**ok, "max_tokens": 10**6}),
            (_auth(), {"model": server.model}),
        ]:
            r = httpx.post(url, json=body, headers=headers, timeout=60)
            answers.append(r.text.replace(KEY, "<KEY>", 1) if body.get("model") == KEY else r.text)
        for path in ("/health", "/health?check=true", "/metrics", "/openapi.json"):
            answers.append(httpx.get(f"{server.url}{path}", timeout=30).text)
        answers.append(httpx.get(f"{server.url}/v1/models", headers=_auth(), timeout=30).text)
        other = _non_loopback_address()
        if other is not None:  # bound to loopback only: another interface refuses
            port = server.url.rsplit(":", 1)[1]
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{other}:{port}/health", timeout=5)
    finally:
        assert stop_server(server) == 0
    log = server.log()
    assert "auth on" in log  # the start-up line says auth is on without printing the key
    assert KEY not in log and KEY[:12] not in log
    leaked = [a[:200] for a in answers if KEY in a]
    assert leaked == []
