"""OLMoE parity with transformers (full-projection q/k norm, clip_qkv) at every budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.parity import check_parity, fuse_experts, make_checkpoint, min_budget

# clip_qkv 1.0 clamps many normed q/k and raw v entries, so the clamp-vs-norm order matters.
# Three MoE layers of 8 experts, 24 routed experts in all.
TINY = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=4,
    clip_qkv=1.0,
    vocab_size=256,
    max_position_embeddings=256,
    eos_token_id=2,  # the default eos id lies outside the tiny vocab
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("olmoe"), "olmoe", **TINY)


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("olmoe_fused"), "olmoe", seed=1, **TINY)
    fuse_experts(path)
    return path


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_parity_budgets(ckpt: Path, budget: str | None) -> None:
    stats = check_parity(ckpt, min_budget(ckpt) if budget == "min" else budget)
    if budget is None:
        assert stats["disk_reads"] == 0 and stats["evictions"] == 0
    else:
        assert stats["disk_reads"] > 0 and stats["evictions"] > 0


def test_parity_host_tier_below_routed_bytes(ckpt: Path) -> None:
    # With top-4 of 8 a step touches nearly every expert of a layer, so a host tier at half the
    # routed bytes is cycled through by LRU and never hits; three quarters is still partial.
    stats = check_parity(ckpt, "50%", host_budget="75%")
    assert stats["host_rows"] == 18 and stats["disk_reads"] > 0 and stats["host_hits"] > 0


@pytest.mark.parametrize("budget", [None, "min"])
def test_parity_fused_layout(fused_ckpt: Path, budget: str | None) -> None:
    check_parity(fused_ckpt, min_budget(fused_ckpt) if budget == "min" else budget)


def test_parity_norm_topk_prob_and_no_clip(tmp_path: Path) -> None:
    # The non-default router (renormalized top-k) and attention without clipping.
    path = make_checkpoint(
        tmp_path, "olmoe", seed=2, **{**TINY, "norm_topk_prob": True, "clip_qkv": None}
    )
    check_parity(path, None)
