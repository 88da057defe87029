"""One tiny checkpoint recipe per family, shared by the cross-family suites (GPU, grouped path)."""

from __future__ import annotations

from typing import Any

from tests.models import (
    test_deepseek_v2,
    test_deepseek_v3,
    test_mixtral,
    test_olmoe,
    test_qwen2_moe,
    test_qwen3_moe,
)

# name -> (transformers model_type, config overrides)
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
