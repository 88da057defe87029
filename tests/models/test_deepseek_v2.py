"""DeepSeek-V2 parity with transformers: MLA without q LoRA (as V2-Lite), softmax routers.

The per-expert checkpoint routes with group_limited_greedy; the fused one with greedy, with
norm_topk_prob set (HF's V2 router ignores it) and a routed_scaling_factor that HF applies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.parity import check_parity, fuse_experts, make_checkpoint, min_budget

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    n_routed_experts=16,
    num_experts_per_tok=3,
    n_shared_experts=2,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
)
MOE_LAYERS = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("dsv2"),
        "deepseek_v2",
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.0,
        **TINY,
    )


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tiny = dict(TINY, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)
    path = make_checkpoint(
        tmp_path_factory.mktemp("dsv2_fused"),
        "deepseek_v2",
        seed=1,
        topk_method="greedy",
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
        **tiny,
    )
    fuse_experts(path)
    return path


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_parity_budgets(ckpt: Path, budget: str | None) -> None:
    stats = check_parity(ckpt, min_budget(ckpt) if budget == "min" else budget)
    assert stats["total_experts"] == MOE_LAYERS * TINY["n_routed_experts"]
    if budget is None:
        assert stats["disk_reads"] == 0 and stats["evictions"] == 0
    else:
        assert stats["disk_reads"] > 0 and stats["evictions"] > 0


def test_parity_host_tier_below_routed_bytes(ckpt: Path) -> None:
    stats = check_parity(ckpt, "25%", host_budget="50%")
    assert 0 < stats["host_rows"] < stats["total_experts"]
    assert stats["disk_reads"] > 0 and stats["host_hits"] > 0


@pytest.mark.parametrize("budget", [None, "min"])
def test_parity_fused_layout(fused_ckpt: Path, budget: str | None) -> None:
    check_parity(fused_ckpt, min_budget(fused_ckpt) if budget == "min" else budget)
