"""SIGTERM while requests are in flight: the server stops accepting at once, lets them finish
within the grace period (every token, then [DONE]) or, once it is over, ends them with a final
error event then [DONE] (streams) or a 503 (non-streaming), and exits 0."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer, start_server
from tests.server.tiny import make_tiny_server_model

GRACE_S = 2.0  # long enough to see new connections refused while a stream is still open
LONG = 8000  # tokens: a minute or more on the CPU, far beyond the grace period


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny server checkpoint with a context long enough for streams that outlive GRACE_S."""
    path = tmp_path_factory.mktemp("tiny-long") / "tiny-moe"
    return make_tiny_server_model(path, max_position_embeddings=LONG + 64)


def _wait(server: LiveServer) -> int:
    try:
        return server.proc.wait(timeout=90)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_sigterm_drains_in_flight_stream(tiny_model: Path, tmp_path: Path) -> None:
    server = start_server(tiny_model, tmp_path / "server.log", "--shutdown-grace-s", "60")
    body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    events: list[str] = []
    first = threading.Event()

    def consume() -> None:
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", f"{server.url}/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert first.wait(60)
    server.proc.terminate()
    at_sigterm = len(events)
    reader.join(120)
    code = _wait(server)
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert len(tokens) == 200, len(tokens)
    assert at_sigterm < len(events) - 1, "the stream had ended before SIGTERM: nothing drained"
    assert code == 0, server.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)


def test_sigterm_ends_requests_that_outlive_the_grace_period(
    long_model: Path, tmp_path: Path
) -> None:
    server = start_server(long_model, tmp_path / "server.log", "--shutdown-grace-s", str(GRACE_S))
    base = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    events: list[tuple[float, str]] = []  # (time.monotonic(), data) of each SSE event
    blocking: list[httpx.Response] = []

    def stream() -> None:
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", f"{server.url}/v1/completions", json={**base, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line[6:]))

    def non_streaming() -> None:
        blocking.append(httpx.post(f"{server.url}/v1/completions", json=base, timeout=120))

    readers = [threading.Thread(target=stream), threading.Thread(target=non_streaming)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + 60
    while server.health()["num_requests_running"] < 2 or not events:
        assert time.monotonic() < deadline, "the two requests never ran together"
        time.sleep(0.1)

    server.proc.terminate()
    sigterm = time.monotonic()
    refused_while_open = _refused(server, lambda: any(_is_error(e) for _, e in events))
    for t in readers:
        t.join(120)
    code = _wait(server)

    assert refused_while_open, "a new connection was accepted after SIGTERM"
    assert events[-1][1] == "[DONE]", events[-3:]
    ended_at, last = events[-2]
    error = json.loads(last)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "server_error" and error["code"] == "503", error
    assert "shutdown grace period" in error["message"], error
    assert ended_at - sigterm >= GRACE_S - 0.2, "ended before the grace period was over"
    chunks = [json.loads(e)["choices"][0] for _, e in events[:-2]]
    assert all(c["finish_reason"] is None for c in chunks)
    assert 0 < sum(len(c["token_ids"]) for c in chunks) < LONG
    assert len(blocking) == 1 and blocking[0].status_code == 503, blocking
    assert blocking[0].json()["error"]["type"] == "server_error", blocking[0].text
    assert "shutdown grace period" in blocking[0].json()["error"]["message"]
    assert code == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


def _is_error(data: str) -> bool:
    return data.startswith('{"error"')


def _refused(server: LiveServer, stream_ended: Any) -> bool:
    """Poll until a new connection is refused; whether the stream was still open then (so the
    refusal came from the server that is shutting down, not from a process already gone)."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{server.url}/health", timeout=1)
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            # refused, or (a race with the listener closing) taken by the kernel's backlog and
            # closed unanswered: either way the server no longer serves new connections
            return not stream_ended() and server.proc.poll() is None
        time.sleep(0.05)
    return False
