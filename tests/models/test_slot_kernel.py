"""The slot-reading MoE path (kernels/expert_ffn.py) keeps parity for every family.

On CUDA it is the default for decode-sized steps; here it is forced on the CPU (where the
kernel's PyTorch reference runs) so CI covers the routing, slot lookup and ordering logic: with
every expert resident (device slot table, no host decision) and with offloading (one wave).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import FAMILIES
from tests.models.parity import check_parity, min_budget


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[request.param].checkpoint(tmp_path_factory.mktemp(request.param), seed=3)


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_slot_kernel_parity(ckpt: Path, budget: str | None) -> None:
    stats = check_parity(
        ckpt, min_budget(ckpt) if budget == "min" else budget, moe_slot_kernel_max_pairs=1 << 20
    )
    if budget is None:
        # every lookup served by the device table: no host decisions, all hits
        assert stats["requests"] == 0 and stats["resident_lookups"] > 0
        assert stats["device_hit_rate"] == 1.0
    else:
        assert stats["requests"] > 0 and stats["resident_lookups"] == 0
