"""The device-resident expert cache keeps parity: every MoE layer call resolved and filled by
tensor ops (the CPU runs the same ops the CUDA graph captures), at budgets from one layer's
experts up, for prefill and decode; the host's slot table stays unused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def _spy(fn: Any, into: list[Any]) -> Any:
    def wrapped() -> Any:
        out = fn()
        into.extend(out)
        return out

    return wrapped


def test_observers_get_the_same_routes_after_the_step(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench's trace recorder hears of every call of a device-cache step after it (route
    log: no sync per layer, so decode graphs stay on): the same records, in the same order,
    as the host path tells it during the step."""
    from moetier import LLM, SamplingParams
    from moetier.bench.trace import TraceHeader, TraceRecorder

    traces = []
    for kw in (dict(KERNELS), dict(KERNELS, device_cache=False)):
        llm = LLM(str(qwen3), expert_budget="50%", host_budget="100%", progress=False, **kw)
        blocks = llm.engine.runner.model.moe_blocks()
        rec = TraceRecorder(TraceHeader(2, 8, 2, [b.layer for b in blocks], 1))
        rec.attach(blocks)
        cached = llm.engine.runner.expert_cache.device_cache
        taken: list[tuple[int, list[int], int]] = []
        if cached is not None:  # every record comes from the log, after its step
            monkeypatch.setattr(cached, "take_routes", _spy(cached.take_routes, taken))
        llm.generate([[1, 2, 3, 4], [5, 6]], SamplingParams(max_tokens=5, temperature=0.0))
        rec.detach()
        assert (cached is not None) == kw["device_cache"]
        traces.append([(r.layer, r.experts) for r in rec.trace.records])
        if cached is not None:
            assert len(taken) == len(rec.trace.records)
    assert len(traces[0]) > 4 and traces[0] == traces[1]
