"""Llama 4 specifics beyond the cross-family suite: the router's hand-over to MoEBlock survives
a predictor calling other layers' routers mid-layer, and top-k above 1 is refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier import LLM
from moetier.errors import UnsupportedModelError
from tests.models.families import FAMILIES
from tests.models.parity import check_parity
from tests.models.test_prefetch_parity import waves_budget


def test_parity_with_gate_lookahead(tmp_path: Path) -> None:
    # The lookahead calls the next MoE layer's router on this layer's router input (x * score)
    # while this layer's own routing is held: both must stay what HF computes.
    ckpt = FAMILIES["llama4"].checkpoint(tmp_path / "llama4")
    stats = check_parity(ckpt, waves_budget(ckpt), prefetch="gate-lookahead")
    assert stats["prefetches_issued"] > 0 and stats["prefetches_used"] > 0


def test_top_k_above_one_is_refused(tmp_path: Path) -> None:
    ckpt = FAMILIES["llama4"].checkpoint(tmp_path / "llama4", num_experts_per_tok=2)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=2"):
        LLM(str(ckpt), device="cpu", dtype="float32", progress=False)
