"""Qwen3-MoE parity with transformers (per-head q/k norm, dense layer, head_dim) at every budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moetier.models.qwen3_moe import expert_prefixes
from tests.models.parity import check_parity, fuse_experts, make_checkpoint, min_budget

# head_dim 32 != hidden / heads (16), as in real Qwen3-MoE configs. Layer 0 is dense
# (mlp_only_layers): two MoE layers of 8 experts, 16 routed experts in all.
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    vocab_size=256,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", **TINY)


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3_moe_fused"), "qwen3_moe", seed=1, **TINY)
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
    assert stats["host_rows"] == 12 and stats["disk_reads"] > 0 and stats["host_hits"] > 0


@pytest.mark.parametrize("budget", [None, "min"])
def test_parity_fused_layout(fused_ckpt: Path, budget: str | None) -> None:
    check_parity(fused_ckpt, min_budget(fused_ckpt) if budget == "min" else budget)


def test_parity_attention_bias_no_topk_norm(tmp_path: Path) -> None:
    # attention_bias biases o_proj as well as q/k/v; without norm_topk_prob weights stay raw.
    path = make_checkpoint(
        tmp_path, "qwen3_moe", seed=2, **{**TINY, "attention_bias": True, "norm_topk_prob": False}
    )
    check_parity(path, None)


@pytest.mark.parametrize("overrides", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[1, 2])])
def test_sparse_layers_match_hf(overrides: dict) -> None:
    config = AutoConfig.for_model("qwen3_moe", **{**TINY, "num_hidden_layers": 4, **overrides})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sorted(expert_prefixes(config)) == sparse
