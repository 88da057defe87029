"""The engine process dies mid-stream: the stream ends with an error event then [DONE],
/health says degraded, new requests get 503, and the server itself stays up and stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.server.conftest import LiveServer


def _engine_pid(server: LiveServer) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == server.proc.pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError("no engine process under the server")


def test_engine_death_is_reported_and_server_stays_up(serve: Callable[..., LiveServer]) -> None:
    server = serve()
    body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 200, "stream": True,
            "ignore_eos": True}  # fmt: skip
    events: list[str] = []
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:  # two chunks in: kill the engine once
                os.kill(_engine_pid(server), signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine process exited" in error["message"] and error["type"] == "server_error"
    deadline = time.monotonic() + 10
    while (h := httpx.get(f"{server.url}/health")).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert h.json()["status"] == "degraded"
    r2 = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": [1]})
    assert r2.status_code == 503 and r2.json()["error"]["type"] == "server_error"
