"""Live servers for the reliability tests: the tiny server checkpoint, started per module.

Counts scale with environment variables so scripts/stress.sh runs the same tests longer:
MOETIER_FUZZ_EXAMPLES (API fuzzing), MOETIER_LOAD_CLIENTS (concurrent streams).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import LiveServer, start_server, stop_server
from tests.server.tiny import make_tiny_server_model

StartServer = Callable[..., LiveServer]


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def record(name: str, figures: dict[str, Any]) -> None:
    """Append one test's figures to $MOETIER_STRESS_RECORD (a JSON-lines file), if set."""
    path = os.environ.get("MOETIER_STRESS_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_server_model(tmp_path_factory.mktemp("tiny") / "tiny-moe")


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """`serve(model, *extra_args)`; servers get SIGTERM at module end and must exit 0."""
    started: list[LiveServer] = []

    def _start(model: Path, *extra: str) -> LiveServer:
        log = tmp_path_factory.mktemp("server") / "server.log"
        started.append(start_server(model, log, *extra))
        return started[-1]

    yield _start
    codes = [stop_server(s) for s in started]
    assert codes == [0] * len(codes), f"servers exited {codes} on SIGTERM"
