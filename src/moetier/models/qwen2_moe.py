"""Qwen2-MoE: q/k/v-biased attention, softmax top-k router, sigmoid-gated shared expert.

Also owns what Qwen3-MoE reuses: the dense-vs-sparse layer rule and the sliding-window guard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import UnsupportedModelError
from moetier.layers.attention import Attention
from moetier.layers.mlp import GatedMLP
from moetier.layers.moe import MoEBlock, SoftmaxTopKRouter, moe_config
from moetier.models.base import CausalLM, DecoderLayer
from moetier.models.registry import Family, register

# Legend: T tokens, D hidden.


class SharedExpertMoEBlock(MoEBlock):
    """Routed experts plus one always-on shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(
        self, layer: int, gate: nn.Module, act: str, hidden: int, shared_intermediate: int
    ) -> None:
        super().__init__(layer, gate, act)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, act)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        shared = F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] * [T, D]
        return self.routed(x) + shared


def is_moe_layer(config: Any, i: int) -> bool:
    """HF's rule: sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return i not in mlp_only and moe_config(config)[0] > 0 and (i + 1) % step == 0


def make_router(config: Any) -> SoftmaxTopKRouter:
    """Softmax top-k, renormalized only under norm_topk_prob (False by default in HF)."""
    num_experts, top_k, _ = moe_config(config)
    normalize = bool(getattr(config, "norm_topk_prob", False))
    return SoftmaxTopKRouter(config.hidden_size, num_experts, top_k, normalize=normalize)


def reject_sliding_window(config: Any, sliding: bool) -> None:
    if sliding:
        raise UnsupportedModelError(
            f"{config.architectures[0] if config.architectures else config.model_type}: sliding-"
            f"window attention (use_sliding_window=True, sliding_window={config.sliding_window}) "
            "is not supported by moetier; set use_sliding_window to false in config.json if the "
            "window exceeds your context length"
        )


def build(config: Any) -> CausalLM:
    layer_types = getattr(config, "layer_types", None) or []
    reject_sliding_window(config, "sliding_attention" in layer_types)
    layers = []
    for i in range(config.num_hidden_layers):
        attn = Attention(config, i, bias=bool(getattr(config, "qkv_bias", True)))
        mlp: nn.Module
        if is_moe_layer(config, i):
            mlp = SharedExpertMoEBlock(
                i,
                make_router(config),
                config.hidden_act,
                config.hidden_size,
                config.shared_expert_intermediate_size,
            )
            # HF casts the top-k weights back to the activation dtype before scaling experts.
            mlp.weights_dtype_cast = True
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        layers.append(DecoderLayer(config, attn, mlp))
    return CausalLM(config, layers)


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    return {
        i: [f"model.layers.{i}.mlp"]
        for i in range(config.num_hidden_layers)
        if is_moe_layer(config, i)
    }


FAMILY = register("Qwen2MoeForCausalLM")(Family("qwen2_moe", build, expert_prefixes))
