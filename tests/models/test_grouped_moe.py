"""The grouped MoE fast path (one gather, two bmm per wave) keeps parity for every family.

On CUDA it is the default for small waves; here it is forced on the CPU so CI covers it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.models import (
    test_deepseek_v2,
    test_deepseek_v3,
    test_mixtral,
    test_olmoe,
    test_qwen2_moe,
    test_qwen3_moe,
)
from tests.models.parity import check_parity, make_checkpoint, min_budget

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", test_mixtral.TINY),
    "qwen2_moe": ("qwen2_moe", test_qwen2_moe.TINY),
    "qwen3_moe": ("qwen3_moe", test_qwen3_moe.TINY),
    "olmoe": ("olmoe", test_olmoe.TINY),
    "deepseek_v2": (
        "deepseek_v2",
        dict(test_deepseek_v2.TINY, topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    "deepseek_v3": ("deepseek_v3", test_deepseek_v3.TINY),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, tiny = CASES[request.param]
    return make_checkpoint(tmp_path_factory.mktemp(request.param), model_type, seed=2, **tiny)


@pytest.mark.parametrize("budget", ["50%", "min"])
def test_grouped_path_parity(ckpt: Path, budget: str) -> None:
    check_parity(
        ckpt, min_budget(ckpt) if budget == "min" else budget, moe_grouped_max_bytes=1 << 30
    )
