"""DeepSeek-V2 and V3: MLA attention, dense leading layers, routed + shared experts.

One builder with two switches per version: the rope variant of MLA and the router (V2: softmax
with greedy / group-limited greedy; V3: sigmoid with bias-corrected group top-k). Everything
else (layer layout, shared experts, checkpoint names) is common to both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moetier.errors import UnsupportedModelError
from moetier.layers.deepseek_router import DeepseekRouter
from moetier.layers.mla import MLAttention
from moetier.layers.mlp import GatedMLP
from moetier.layers.moe import MoEBlock, moe_config
from moetier.models.base import CausalLM, DecoderLayer
from moetier.models.registry import Family, register


class DeepseekMoE(MoEBlock):
    """Routed experts plus always-on shared experts (`mlp.shared_experts.*`), summed as in HF."""

    def __init__(
        self, layer: int, gate: nn.Module, act: str, hidden: int, shared_inter: int
    ) -> None:
        super().__init__(layer, gate, act)
        self.shared_experts = GatedMLP(hidden, shared_inter, act) if shared_inter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)  # [T, D]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def is_moe_layer(config: Any, i: int) -> bool:
    """Layers from first_k_dense_replace on are MoE. moe_layer_freq is DeepSeek's remote-code
    rule (every checkpoint released uses 1); HF ignores it, which is the same thing at 1."""
    first_dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    return i >= first_dense and i % freq == 0


def v2_router(config: Any) -> DeepseekRouter:
    num_experts, top_k, _ = moe_config(config)
    # HF's DeepseekV2TopkRouter drops norm_topk_prob and always applies routed_scaling_factor.
    return DeepseekRouter(
        config.hidden_size,
        num_experts,
        top_k,
        "softmax",
        config.topk_method or "greedy",
        config.n_group,
        config.topk_group,
        normalize=False,
        scaling=config.routed_scaling_factor,
    )


def v3_router(config: Any) -> DeepseekRouter:
    num_experts, top_k, _ = moe_config(config)
    # HF's V3 router is always sigmoid + noaux_tc, whatever scoring_func/topk_method say.
    return DeepseekRouter(
        config.hidden_size,
        num_experts,
        top_k,
        "sigmoid",
        "noaux_tc",
        config.n_group or 1,
        config.topk_group or 1,
        normalize=bool(config.norm_topk_prob),
        scaling=config.routed_scaling_factor,
    )


def make_builder(
    router: Callable[[Any], DeepseekRouter], rope_style: Callable[[Any], str]
) -> Callable[[Any], CausalLM]:
    def build(config: Any) -> CausalLM:
        if getattr(config, "mlp_bias", False):
            # GatedMLP (dense layers, shared experts) has no biases; no released checkpoint has.
            raise UnsupportedModelError("DeepSeek checkpoints with mlp_bias are not supported")
        _, _, moe_inter = moe_config(config)
        shared_inter = moe_inter * int(getattr(config, "n_shared_experts", 0) or 0)
        d, act = config.hidden_size, config.hidden_act
        layers = []
        for i in range(config.num_hidden_layers):
            mlp: nn.Module
            if is_moe_layer(config, i):
                mlp = DeepseekMoE(i, router(config), act, d, shared_inter)
            else:
                mlp = GatedMLP(d, config.intermediate_size, act)
            layers.append(DecoderLayer(config, MLAttention(config, i, rope_style(config)), mlp))
        return CausalLM(config, layers)

    return build


def v3_rope_style(config: Any) -> str:
    return "interleave" if getattr(config, "rope_interleave", True) else "half"


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    layers = range(config.num_hidden_layers)
    return {i: [f"model.layers.{i}.mlp"] for i in layers if is_moe_layer(config, i)}


V2 = register("DeepseekV2ForCausalLM")(
    Family("deepseek_v2", make_builder(v2_router, lambda _: "complex"), expert_prefixes)
)
V3 = register("DeepseekV3ForCausalLM")(
    Family("deepseek_v3", make_builder(v3_router, v3_rope_style), expert_prefixes)
)
