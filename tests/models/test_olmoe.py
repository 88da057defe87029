"""OLMoE's non-default options: renormalized top-k and attention without clipping."""

from __future__ import annotations

from pathlib import Path

from tests.models.families import FAMILIES
from tests.models.parity import check_parity


def test_parity_norm_topk_prob_and_no_clip(tmp_path: Path) -> None:
    path = FAMILIES["olmoe"].checkpoint(tmp_path, seed=2, norm_topk_prob=True, clip_qkv=None)
    check_parity(path, None)
