"""The device-resident expert cache keeps parity: every MoE layer call resolved and filled by
tensor ops (the CPU runs the same ops the CUDA graph captures), at budgets from one layer's
experts up, for prefill and decode; the host's slot table stays unused."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier.errors import BudgetError, ConfigError
from tests.models.families import FAMILIES
from tests.models.parity import check_parity

KERNELS = dict(moe_grouped_kernel=True, moe_slot_kernel_max_pairs=16, device_cache=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES["qwen3_moe"].checkpoint(tmp_path_factory.mktemp("qwen3"), seed=2)


@pytest.mark.parametrize("budget", ["75%", "50%"])
def test_device_cache_parity(qwen3: Path, budget: str) -> None:
    # 2 MoE layers x 8 experts: 50% is one layer's experts, the least the device cache takes
    stats = check_parity(qwen3, budget, host_budget="100%", **KERNELS)
    assert stats["requests"] > 0 and stats["device_hits"] > 0 and stats["host_hits"] > 0
    assert stats["evictions"] > 0
    assert stats["resident_lookups"] == 0 and stats["moe_calls_host_decode"] == 0
    assert stats["bytes_host_to_device"] == stats["host_hits"] * stats["expert_bytes"]
    assert stats["moe_calls_device_decode"] > 0


def test_deepseek_device_cache_parity(tmp_path: Path) -> None:
    ckpt = FAMILIES["deepseek_v3"].checkpoint(tmp_path, seed=2)
    stats = check_parity(ckpt, "50%", host_budget="100%", **KERNELS)
    assert stats["host_hits"] > 0 and stats["moe_calls_host_prefill"] == 0


def test_device_cache_needs_the_host_tier_and_a_layer(qwen3: Path) -> None:
    from moetier import LLM

    with pytest.raises(BudgetError, match="host RAM, which must hold every routed expert"):
        LLM(str(qwen3), expert_budget="50%", host_budget="50%", progress=False, **KERNELS)
    with pytest.raises(BudgetError, match="one layer's 8 experts to fit the expert budget"):
        LLM(str(qwen3), expert_budget="25%", host_budget="100%", progress=False, **KERNELS)
    with pytest.raises(ConfigError, match="--prefetch is driven by the host"):
        LLM(str(qwen3), expert_budget="50%", host_budget="100%", prefetch="last-call",
            progress=False, **KERNELS)  # fmt: skip
