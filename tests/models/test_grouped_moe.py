"""The grouped MoE fast path (one gather, two bmm per wave) keeps parity for every family.

On CUDA it is the default for small waves; here it is forced on the CPU so CI covers it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import CASES
from tests.models.parity import check_parity, make_checkpoint, min_budget


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, tiny = CASES[request.param]
    return make_checkpoint(tmp_path_factory.mktemp(request.param), model_type, seed=2, **tiny)


@pytest.mark.parametrize("budget", ["50%", "min"])
def test_grouped_path_parity(ckpt: Path, budget: str) -> None:
    check_parity(
        ckpt, min_budget(ckpt) if budget == "min" else budget, moe_grouped_max_bytes=1 << 30
    )
