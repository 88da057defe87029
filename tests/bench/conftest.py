"""Bench tests: synthetic checkpoints go to a per-session MOETIER_HOME."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def bench_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("moetier-home")
    old = os.environ.get("MOETIER_HOME")
    os.environ["MOETIER_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("MOETIER_HOME", None)
    else:
        os.environ["MOETIER_HOME"] = old
