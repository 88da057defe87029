"""The grouped MoE fast path (one gather, two bmm per wave) keeps parity for every family.

On CUDA it is the default for small waves; here it is forced on the CPU so CI covers it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import FAMILIES
from tests.models.parity import check_parity, min_budget


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[request.param].checkpoint(tmp_path_factory.mktemp(request.param), seed=2)


@pytest.mark.parametrize("budget", ["50%", "min"])
def test_grouped_path_parity(ckpt: Path, budget: str) -> None:
    check_parity(
        ckpt, min_budget(ckpt) if budget == "min" else budget, moe_grouped_max_bytes=1 << 30
    )
