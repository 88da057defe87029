"""Mixtral: Llama-style attention, softmax top-k router renormalized, no shared experts."""

from __future__ import annotations

from typing import Any

from moetier.layers.attention import Attention
from moetier.layers.moe import MoEBlock, SoftmaxTopKRouter, moe_config
from moetier.models.base import CausalLM, DecoderLayer
from moetier.models.registry import Family, register


def build(config: Any) -> CausalLM:
    num_experts, top_k, _ = moe_config(config)
    layers = []
    for i in range(config.num_hidden_layers):
        router = SoftmaxTopKRouter(config.hidden_size, num_experts, top_k, normalize=True)
        moe = MoEBlock(i, router, config.hidden_act)
        layers.append(DecoderLayer(config, Attention(config, i), moe, mlp_name="block_sparse_moe"))
    return CausalLM(config, layers)


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    return {
        i: [f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"]
        for i in range(config.num_hidden_layers)
    }


FAMILY = register("MixtralForCausalLM")(
    Family("mixtral", build, expert_prefixes, ((".block_sparse_moe.", ".mlp."),))
)
