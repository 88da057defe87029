"""Every family equals transformers token for token (and in logits) at every expert budget,
with the disk tier on, and in the fused expert layout. Family-specific variants live in the
per-family test files; the recipes in families.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import FAMILIES, Family
from tests.models.parity import check_parity, min_budget


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def ckpt(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family.checkpoint(tmp_path_factory.mktemp(family.model_type))


@pytest.fixture(scope="module")
def fused_ckpt(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family.fused_checkpoint(tmp_path_factory.mktemp(f"{family.model_type}_fused"))


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_parity_budgets(family: Family, ckpt: Path, budget: str | None) -> None:
    stats = check_parity(ckpt, min_budget(ckpt) if budget == "min" else budget)
    assert stats["total_experts"] == family.routed_experts
    if budget is None:
        assert stats["disk_reads"] == 0 and stats["evictions"] == 0
    else:
        assert stats["disk_reads"] > 0 and stats["evictions"] > 0


def test_parity_host_tier_below_routed_bytes(family: Family, ckpt: Path) -> None:
    expert_budget, host_budget = family.host_case
    stats = check_parity(ckpt, expert_budget, host_budget=host_budget)
    assert stats["host_rows"] == family.host_rows < family.routed_experts
    assert stats["disk_reads"] > 0 and stats["host_hits"] > 0


@pytest.mark.parametrize("budget", [None, "min"])
def test_parity_fused_layout(fused_ckpt: Path, budget: str | None) -> None:
    check_parity(fused_ckpt, min_budget(fused_ckpt) if budget == "min" else budget)
