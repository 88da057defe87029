"""Greedy tokens and logits equal transformers' with next-layer prefetch on: prefetched slots,
cancelled stale loads and background disk reads never change what a layer computes with.

The budget is two steps' worth of top-k slots (at the minimum budget every slot is pinned by
the running wave and nothing can be prefetched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.models.families import FAMILIES
from tests.models.parity import check_parity


def two_waves_budget(path: Path, dtype_bytes: int = 4) -> str:
    cfg = json.loads((path / "config.json").read_text())
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return f"{2 * cfg['num_experts_per_tok'] * 3 * cfg['hidden_size'] * inter * dtype_bytes}B"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parity_with_same_index_prefetch(family: str, tmp_path: Path) -> None:
    ckpt = FAMILIES[family].checkpoint(tmp_path / family)
    stats = check_parity(ckpt, two_waves_budget(ckpt), prefetch="same-index")
    assert stats["prefetches_issued"] > 0 and stats["disk_reads"] > 0
    assert stats["prefetches_used"] <= stats["prefetches_issued"]


@pytest.mark.parametrize("predictor", ["activation", "gate-lookahead"])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_parity_with_predictors(family: str, predictor: str, tmp_path: Path) -> None:
    ckpt = FAMILIES[family].checkpoint(tmp_path / family)
    stats = check_parity(ckpt, two_waves_budget(ckpt), prefetch=predictor)
    assert stats["prefetches_issued"] > 0
    if predictor == "gate-lookahead":  # the next router on this hidden state: often right
        assert stats["prefetches_used"] > 0


def test_parity_prefetch_two_ahead_with_host_tier(tmp_path: Path) -> None:
    family = FAMILIES["mixtral"]
    ckpt = family.checkpoint(tmp_path / "mixtral")
    expert_budget, host_budget = family.host_case
    stats = check_parity(
        ckpt, expert_budget, host_budget=host_budget, prefetch="gate-lookahead", prefetch_ahead=2
    )
    assert stats["host_rows"] == family.host_rows
    assert stats["prefetches_issued"] > 0 and stats["host_hits"] > 0
