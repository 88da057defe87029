"""OLMoE: q/k RMSNorm over the whole projection, optional clip_qkv, softmax top-k router."""

from __future__ import annotations

from typing import Any

from moetier.layers.attention import Attention
from moetier.layers.moe import MoEBlock
from moetier.models.base import CausalLM, DecoderLayer
from moetier.models.qwen2_moe import make_router
from moetier.models.registry import Family, register


def build(config: Any) -> CausalLM:
    bias = bool(getattr(config, "attention_bias", False))
    layers = []
    for i in range(config.num_hidden_layers):
        # Attention reads clip_qkv from the config and clamps after the q/k norms, as HF does.
        attn = Attention(config, i, bias=bias, qk_norm="full", o_bias=bias)
        # Every layer is sparse; norm_topk_prob defaults to False (no renormalization).
        moe = MoEBlock(i, make_router(config), config.hidden_act)
        # HF casts the top-k weights back to the activation dtype before scaling experts.
        moe.weights_dtype_cast = True
        layers.append(DecoderLayer(config, attn, moe))
    return CausalLM(config, layers)


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    return {i: [f"model.layers.{i}.mlp"] for i in range(config.num_hidden_layers)}


FAMILY = register("OlmoeForCausalLM")(Family("olmoe", build, expert_prefixes))
