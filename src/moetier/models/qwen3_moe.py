"""Qwen3-MoE: per-head q/k RMSNorm attention, softmax top-k router, no shared expert."""

from __future__ import annotations

from typing import Any

from torch import nn

from moetier.layers.attention import Attention
from moetier.layers.mlp import GatedMLP
from moetier.layers.moe import MoEBlock
from moetier.models.base import CausalLM, DecoderLayer
from moetier.models.qwen2_moe import (
    expert_prefixes,
    is_moe_layer,
    make_router,
    reject_sliding_window,
)
from moetier.models.registry import Family, register


def build(config: Any) -> CausalLM:
    # HF keeps sliding_window only when use_sliding_window is set, then windows every layer.
    reject_sliding_window(config, getattr(config, "sliding_window", None) is not None)
    bias = bool(getattr(config, "attention_bias", False))
    layers = []
    for i in range(config.num_hidden_layers):
        # attention_bias biases o_proj too; head_dim comes from the config (not hidden / heads).
        attn = Attention(config, i, bias=bias, qk_norm="head", o_bias=bias)
        mlp: nn.Module
        if is_moe_layer(config, i):
            mlp = MoEBlock(i, make_router(config), config.hidden_act)
            # HF casts the top-k weights back to the activation dtype before scaling experts.
            mlp.weights_dtype_cast = True
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        layers.append(DecoderLayer(config, attn, mlp))
    return CausalLM(config, layers)


FAMILY = register("Qwen3MoeForCausalLM")(Family("qwen3_moe", build, expert_prefixes))
