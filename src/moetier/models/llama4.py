"""Llama 4 text (Llama4ForCausalLM): RoPE/NoPE attention layers (layers/llama4_attention.py),
MoE layers interleaved with dense ones, a top-1 sigmoid router whose score scales the expert's
input, and a shared expert. Routed experts are stored fused and transposed
(`experts.gate_up_proj` [E, D, 2I], `experts.down_proj` [E, I, D]); weights/experts.py reads
that layout.

Only one expert per token is supported (every released Llama 4 routes top-1): see
layers/llama4_router.py for why the input scaling fits MoEBlock at top-1 only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetier.errors import UnsupportedModelError
from moetier.layers.llama4_attention import Llama4Attention
from moetier.layers.llama4_router import SigmoidTop1Router
from moetier.layers.mlp import GatedMLP
from moetier.layers.moe import MoEBlock, moe_config
from moetier.models.base import CausalLM, DecoderLayer
from moetier.models.registry import Family, register

# Legend: T tokens, D hidden.


class Llama4MoE(MoEBlock):
    """Routed experts fed x * score with weight 1, plus the always-on `shared_expert`."""

    def __init__(self, layer: int, config: Any) -> None:
        num_experts, _, inter = moe_config(config)
        d, act = config.hidden_size, config.hidden_act
        super().__init__(layer, SigmoidTop1Router(d, num_experts), act)
        self.shared_expert = GatedMLP(d, inter, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]. HF adds the routed sum to the shared output (same sum)."""
        if not isinstance(self.gate, SigmoidTop1Router):
            # A swapped-in router (the bench's routing override) weighs outputs as usual.
            return self.routed(x) + self.shared_expert(x)
        ids, scores = self.gate.scores(x)  # [T, 1], [T, 1]
        self.gate.hold(ids)  # the routed path's gate call gets these ids with weight 1.0
        try:
            routed = self.routed(x * scores)  # the expert sees the scaled token, as in HF
        finally:
            self.gate.hold(None)
        return routed + self.shared_expert(x)


def is_moe_layer(config: Any, i: int) -> bool:
    """HF's moe_layers (from interleave_moe_layer_step when the config leaves it out)."""
    return i in (config.moe_layers or [])


def build(config: Any) -> CausalLM:
    _, top_k, _ = moe_config(config)
    if top_k != 1:
        raise UnsupportedModelError(
            f"Llama 4 with num_experts_per_tok={top_k} is not supported: its router scales each "
            "expert's input, which moetier computes for one expert per token only (every "
            "released Llama 4 uses num_experts_per_tok=1)"
        )
    layers = []
    for i in range(config.num_hidden_layers):
        mlp: nn.Module
        if is_moe_layer(config, i):
            mlp = Llama4MoE(i, config)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size_mlp, config.hidden_act)
        attn = Llama4Attention(config, i)
        layers.append(DecoderLayer(config, attn, mlp, mlp_name="feed_forward"))
    return CausalLM(config, layers)


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    layers = range(config.num_hidden_layers)
    return {i: [f"model.layers.{i}.feed_forward"] for i in layers if is_moe_layer(config, i)}


FAMILY = register("Llama4ForCausalLM")(
    Family("llama4", build, expert_prefixes, ((".feed_forward.gate.", ".feed_forward.router."),))
)
