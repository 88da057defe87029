"""The grouped expert kernel's path (kernels/grouped_ffn.py) keeps parity for every family.

On CUDA it runs every step larger than the slot kernel's limit (prefill, large batches); here
it is forced on for every step on the CPU, where its PyTorch reference runs, so CI covers the
routing, slot lookup, wave masking and ordering logic: with every expert resident (device slot
table, no host decision), with one wave and with several (the minimum budget). A family whose
activation the kernel does not compute must fall back to the per-expert loop, with the same
parity; gpt-oss's and DeepSeek-V4's clamped SwiGLUs and Gemma 4's GELU-tanh take the kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import FAMILIES
from tests.models.parity import check_parity, min_budget, moe_kernels_apply


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[request.param].checkpoint(tmp_path_factory.mktemp(request.param), seed=2)


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_grouped_kernel_parity(ckpt: Path, budget: str | None) -> None:
    stats = check_parity(
        ckpt,
        min_budget(ckpt) if budget == "min" else budget,
        moe_grouped_kernel=True,
        moe_slot_kernel_max_pairs=0,
    )
    if not moe_kernels_apply(ckpt):  # every call falls back to the per-expert loop
        assert stats["resident_lookups"] == 0 and stats["requests"] > 0
    elif budget is None:  # every lookup served by the device table: no host decision
        assert stats["requests"] == 0 and stats["resident_lookups"] > 0
    else:
        assert stats["requests"] > 0 and stats["resident_lookups"] == 0
