"""Qwen2-MoE parity with transformers (shared expert, dense layer, q/k/v bias) at every budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moetier.models.qwen2_moe import expert_prefixes
from tests.models.parity import check_parity, fuse_experts, make_checkpoint, min_budget

# Layer 1 is dense (mlp_only_layers): two MoE layers of 8 experts, 16 routed experts in all.
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=4,
    mlp_only_layers=[1],
    vocab_size=256,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", **TINY)


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("qwen2_moe_fused"), "qwen2_moe", seed=1, **TINY)
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


@pytest.mark.parametrize("overrides", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[0, 3])])
def test_sparse_layers_match_hf(overrides: dict) -> None:
    config = AutoConfig.for_model("qwen2_moe", **{**TINY, "num_hidden_layers": 4, **overrides})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sorted(expert_prefixes(config)) == sparse
