"""Live `moetier serve` processes on 127.0.0.1 (a random free port) over a tiny checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.tiny import make_tiny_server_model

API_KEY = "sk-test-3f9a1c0e"
# CPU in CI; MOETIER_TEST_DEVICE=cuda runs the same suite against a GPU server.
DEVICE = os.environ.get("MOETIER_TEST_DEVICE", "cpu")


@dataclass
class LiveServer:
    url: str
    model: str
    proc: subprocess.Popen[str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict[str, float]:
        """Fresh engine counters after the engine's KV and expert-slot integrity checks."""
        r = httpx.get(f"{self.url}/health", params={"check": "true"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_server_model(tmp_path_factory.mktemp("tiny") / "tiny-moe")


def wait_idle(server: LiveServer, timeout_s: float = 30.0) -> dict[str, float]:
    """/health once nothing runs or waits (the last response may precede the step that frees
    its request); /health also checks KV and expert-cache integrity."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = server.health()
        if h["num_requests_running"] == 0 and h["num_requests_waiting"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


def start_server(model: Path, log_path: Path, *extra: str) -> LiveServer:
    return wait_until_up(launch_server(model, log_path, *extra))


def launch_server(model: Path, log_path: Path, *extra: str) -> LiveServer:
    """Start `moetier serve` and return at once (`wait_until_up` waits for it): the caller
    may work while the server loads."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    env.pop("MOETIER_API_KEY", None)
    cmd = [sys.executable, "-m", "moetier", "serve", str(model), "--port", str(port)]
    cmd += ["--device", DEVICE, "--dtype", "float32", *extra]
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    return LiveServer(f"http://127.0.0.1:{port}", model.name, proc, log_path)


def wait_until_up(server: LiveServer) -> LiveServer:
    """Poll /health until the server answers; raise with its log if it exits or never does."""
    proc = server.proc
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not come up:\n{server.log()}")


def stop_server(server: LiveServer) -> int:
    """SIGTERM, as a service manager would; the exit code (0 after a graceful stop)."""
    server.proc.terminate()
    try:
        return server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        return -9


@pytest.fixture(scope="module")
def serve(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Module fixtures call `serve(*extra_args)`; servers stop at module end."""
    started: list[LiveServer] = []

    def _start(*extra: str) -> LiveServer:
        log = tmp_path_factory.mktemp("server") / "server.log"
        started.append(start_server(tiny_model, log, *extra))
        return started[-1]

    yield _start
    codes = [stop_server(s) for s in started]
    assert codes == [0] * len(codes), f"servers exited {codes} on SIGTERM"
