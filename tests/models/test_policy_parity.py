"""Greedy tokens and logits equal transformers' with each layer-aware slot policy (and the
activation-aware one) at the minimum expert budget (every layer call evicts), on two families."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import FAMILIES
from tests.models.parity import check_parity, min_budget


@pytest.mark.parametrize("policy", ["lfru", "least-stale", "layer-lru", "activation"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_parity_with_policy(family: str, policy: str, tmp_path: Path) -> None:
    ckpt = FAMILIES[family].checkpoint(tmp_path / family)
    stats = check_parity(ckpt, min_budget(ckpt), policy=policy)
    assert stats["evictions"] > 0
