"""SIGTERM while a stream is in flight: the server stops accepting, lets the stream finish within
the grace period (every token, then [DONE]), and exits 0."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server


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
    try:
        code = server.proc.wait(timeout=90)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert len(tokens) == 200, len(tokens)
    assert at_sigterm < len(events) - 1, "the stream had ended before SIGTERM: nothing drained"
    assert code == 0, server.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)
