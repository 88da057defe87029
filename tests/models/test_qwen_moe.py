"""Qwen2-MoE and Qwen3-MoE specifics: which layers are sparse, and Qwen3's non-default options."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moetier.models.registry import get_family
from tests.models.families import FAMILIES
from tests.models.parity import check_parity


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("qwen2_moe", dict(decoder_sparse_step=2)),
        ("qwen2_moe", dict(mlp_only_layers=[0, 3])),
        ("qwen3_moe", dict(decoder_sparse_step=2)),
        ("qwen3_moe", dict(mlp_only_layers=[1, 2])),
    ],
)
def test_sparse_layers_match_hf(model_type: str, overrides: dict) -> None:
    tiny = FAMILIES[model_type].tiny
    config = AutoConfig.for_model(model_type, **{**tiny, "num_hidden_layers": 4, **overrides})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    config.architectures = [type(hf).__name__]
    assert sorted(get_family(config).expert_prefixes(config)) == sparse


def test_qwen3_attention_bias_no_topk_norm(tmp_path: Path) -> None:
    # attention_bias biases o_proj as well as q/k/v; without norm_topk_prob weights stay raw.
    path = FAMILIES["qwen3_moe"].checkpoint(
        tmp_path, seed=2, attention_bias=True, norm_topk_prob=False
    )
    check_parity(path, None)
