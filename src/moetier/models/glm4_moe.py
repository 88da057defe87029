"""GLM-4.5 / 4.6 / 4.7 (Glm4Moe): GQA attention with partial rotary, q/k/v bias and optional
per-head q/k norm; leading dense layers; DeepSeek-V3's sigmoid router with correction bias,
group-limited top-k and routed scaling; shared experts.

The MoE layer is DeepSeek-V3's (same router math, same `mlp.shared_experts` module), so it is
reused as is; only the attention differs from DeepSeek (GQA instead of MLA).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moetier.layers.attention import Attention
from moetier.layers.mlp import GatedMLP
from moetier.layers.moe import moe_config
from moetier.models.base import CausalLM, DecoderLayer
from moetier.models.deepseek import DeepseekMoE, v3_router
from moetier.models.registry import Family, register


def is_moe_layer(config: Any, i: int) -> bool:
    """HF's rule: the first `first_k_dense_replace` layers are dense, every later one sparse."""
    return i >= int(config.first_k_dense_replace or 0)


def build(config: Any) -> CausalLM:
    _, _, moe_inter = moe_config(config)
    shared_inter = moe_inter * int(config.n_shared_experts or 0)
    d, act = config.hidden_size, config.hidden_act
    bias = bool(config.attention_bias)
    qk_norm = "head" if getattr(config, "use_qk_norm", False) else None
    layers = []
    for i in range(config.num_hidden_layers):
        # attention_bias biases q/k/v only; o_proj never has a bias in GLM.
        attn = Attention(config, i, bias=bias, qk_norm=qk_norm, partial_rotary=True)
        mlp: nn.Module
        if is_moe_layer(config, i):
            mlp = DeepseekMoE(
                i, v3_router(config), act, d, shared_inter
            )  # Glm4MoeTopkRouter is V3's
        else:
            mlp = GatedMLP(d, config.intermediate_size, act)
        layers.append(DecoderLayer(config, attn, mlp))
    return CausalLM(config, layers)


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    # Layers past num_hidden_layers (the MTP module, model.layers.92 in GLM-4.5) are not run.
    layers = range(config.num_hidden_layers)
    return {i: [f"model.layers.{i}.mlp"] for i in layers if is_moe_layer(config, i)}


FAMILY = register("Glm4MoeForCausalLM")(Family("glm4_moe", build, expert_prefixes))
