"""GPU suites share one checkpoint per family (recipes in tests/models/families.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import FAMILIES


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[request.param].checkpoint(tmp_path_factory.mktemp(request.param))
