"""Qwen3-Next (Qwen3NextForCausalLM): hybrid layers, Gated DeltaNet linear attention
(layers/gated_deltanet.py, fused in_proj_qkvz / in_proj_ba projections) in most layers and
gated full attention (layers/gated_attention.py) in every `full_attention_interval`-th (the
config's `layer_types`); Qwen2-MoE's routed experts with a sigmoid-gated shared expert;
zero-centred RMSNorms ((1 + weight), layers/norm.py OffsetRMSNorm).

The linear-attention layers keep per-sequence recurrent state in the engine's state slots
(engine/state_cache.py), the full-attention layers the paged KV cache. Also owns what Qwen3.5-MoE
(models/qwen3_5_moe.py) reuses: the layer, the model and the layer-type check.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetier.errors import UnsupportedModelError
from moetier.layers.context import ForwardContext
from moetier.layers.gated_attention import GatedAttention
from moetier.layers.gated_deltanet import GatedDeltaNet
from moetier.layers.mlp import GatedMLP
from moetier.layers.moe import SoftmaxTopKRouter, moe_config
from moetier.layers.norm import OffsetRMSNorm
from moetier.models.base import CausalLM
from moetier.models.qwen2_moe import SharedExpertMoEBlock, expert_prefixes, is_moe_layer
from moetier.models.registry import Family, register

# Legend: T tokens, D hidden.

LAYER_TYPES = ("linear_attention", "full_attention")


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block: the layer's token mixer (`linear_attn` or `self_attn`, as
    named in the checkpoint), then its MLP or MoE, with zero-centred norms."""

    def __init__(self, config: Any, layer: int, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.mixer_name = "linear_attn" if isinstance(mixer, GatedDeltaNet) else "self_attn"
        setattr(self, self.mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + getattr(self, self.mixer_name)(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridCausalLM(CausalLM):
    """CausalLM with the zero-centred final norm."""

    def __init__(self, config: Any, layers: list[nn.Module]) -> None:
        super().__init__(config, layers)
        self.model.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)


def layer_types(config: Any) -> list[str]:
    """The config's per-layer mixer kinds, checked: only linear and full attention."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedModelError(
            f"{config.architectures[0] if config.architectures else config.model_type}: "
            f"config.json layer_types must name one of {LAYER_TYPES} per layer "
            f"({config.num_hidden_layers} layers), got {types}"
        )
    return types


def mixer(config: Any, layer: int, kind: str, split_proj: bool) -> nn.Module:
    if kind == "linear_attention":
        return GatedDeltaNet(config, layer, split_proj)
    return GatedAttention(config, layer)


def shared_moe(config: Any, layer: int, normalize: bool) -> SharedExpertMoEBlock:
    num_experts, top_k, _ = moe_config(config)
    router = SoftmaxTopKRouter(config.hidden_size, num_experts, top_k, normalize=normalize)
    block = SharedExpertMoEBlock(
        layer, router, config.hidden_act, config.hidden_size, config.shared_expert_intermediate_size
    )
    # HF casts the top-k weights back to the activation dtype before scaling experts.
    block.weights_dtype_cast = True
    return block


def build(config: Any) -> CausalLM:
    types = layer_types(config)
    normalize = bool(getattr(config, "norm_topk_prob", True))
    layers: list[nn.Module] = []
    for i, kind in enumerate(types):
        mlp: nn.Module
        if is_moe_layer(config, i):
            mlp = shared_moe(config, i, normalize)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        layers.append(HybridDecoderLayer(config, i, mixer(config, i, kind, False), mlp))
    return HybridCausalLM(config, layers)


FAMILY = register("Qwen3NextForCausalLM")(Family("qwen3_next", build, expert_prefixes))
