"""An engine error mid-request, in process with a scripted engine client: streams end with an
error event then [DONE]; JSON answers 500 with an OpenAI error body."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from moetier.engine.outputs import RequestDelta
from moetier.metrics import ServerMetrics
from moetier.server.app import ServerSettings, create_app


class ScriptedClient:
    """Stands in for EngineClient: every request yields one token, then fails."""

    info = {"model": "m", "max_model_len": 64, "vocab_size": 300, "kv_tokens": 1024}
    dead: str | None = None

    def __init__(self) -> None:
        self.streams: dict[int, Any] = {}
        self.aborted: list[int] = []
        self._next = 0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    def new_id(self) -> int:
        self._next += 1
        return self._next

    @property
    def in_flight(self) -> int:
        return 0

    def submit(self, rid: int, ids: list[int], params: Any, out: Any, index: int,
               logprobs: int | None = None) -> None:  # fmt: skip
        out.put_nowait((index, RequestDelta(rid, [65], "A", num_output_tokens=1)))
        fail = RequestDelta(rid, [], "", True, "error", "RuntimeError: injected")
        out.put_nowait((index, fail))

    def abort(self, rid: int) -> None:
        self.aborted.append(rid)

    async def check(self, timeout_s: float = 10.0) -> tuple[str | None, dict[str, float]]:
        return None, {}


@pytest.fixture()
def http() -> TestClient:
    settings = ServerSettings("m")
    app = create_app(ScriptedClient(), None, settings, ServerMetrics("m"))  # type: ignore[arg-type]
    return TestClient(app)


def test_stream_error_event_then_done(http: TestClient) -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 4, "stream": True}
    lines = [ln for ln in http.post("/v1/completions", json=body).text.splitlines() if ln]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "A"
    err = json.loads(lines[1][6:])["error"]
    assert err["message"] == "RuntimeError: injected" and err["type"] == "server_error"
    assert lines[2:] == ["data: [DONE]"]


def test_json_error_is_500(http: TestClient) -> None:
    r = http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 4})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert http.get("/health").json()["status"] == "ok"


def test_health_says_what_is_degraded() -> None:
    client = ScriptedClient()

    async def broken(timeout_s: float = 10.0) -> tuple[str | None, dict[str, float]]:
        return "integrity check failed: blocks leaked", {}

    client.check = broken  # type: ignore[method-assign]
    app = create_app(client, None, ServerSettings("m"), ServerMetrics("m"))  # type: ignore[arg-type]
    http = TestClient(app)
    assert http.get("/health").status_code == 200  # cheap liveness
    r = http.get("/health", params={"check": "true"})
    assert r.status_code == 503 and r.json() == {
        "status": "degraded",
        "error": "integrity check failed: blocks leaked",
    }
    client.dead = "engine process exited (code -9)"
    r = http.get("/health")
    assert r.status_code == 503 and "exited" in r.json()["error"]
