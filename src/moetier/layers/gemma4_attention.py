"""Gemma 4 text attention: per-layer-type geometry, q/k/v RMSNorms, unit softmax scale.

Sliding layers attend to the last `sliding_window` positions with their own head size, KV
heads and rope; full layers use the global head size (and KV heads), proportional rope (a
leading share of the channels rotate) and, under attention_k_eq_v, values taken from the key
projection. Owns the order HF applies these in (norm, then rope; values normed without
weight, never rotated); projections and the attention core are attention.py's. Mirrors
transformers' Gemma4TextAttention.
"""

from __future__ import annotations

from typing import Any

import torch

from moetier.layers.attention import Attention, attend
from moetier.layers.context import ForwardContext
from moetier.layers.norm import GemmaRMSNorm

# Legend: T tokens, H query heads, Hkv KV heads, d head dim.


class Gemma4Attention(Attention):
    """GQA attention of Gemma 4 layer `layer` (its type from `config.layer_types`)."""

    def __init__(self, config: Any, layer: int) -> None:
        layer_type = config.layer_types[layer]
        # The per-layer view carries the full layers' head_dim and num_key_value_heads.
        view = config.per_layer_config[layer]
        bias = bool(config.attention_bias)
        super().__init__(view, layer, bias=bias, o_bias=bias, layer_type=layer_type)
        sliding = layer_type == "sliding_attention"
        self.window: int | None = int(config.sliding_window) if sliding else None
        eps = float(config.rms_norm_eps)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        self.v_norm = GemmaRMSNorm(self.head_dim, eps, with_scale=False)
        # Values are the un-normed keys: the checkpoint has no v_proj for these layers.
        self.values_from_keys = bool(config.attention_k_eq_v) and not sliding
        if self.values_from_keys:
            del self.v_proj

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.n_heads, self.head_dim))  # [T, H, d]
        k = self.k_proj(x).view(t, self.n_kv, self.head_dim)  # [T, Hkv, d]
        v = k if self.values_from_keys else self.v_proj(x).view(t, self.n_kv, self.head_dim)
        k = self.k_norm(k)
        cos, sin = self.rotary(ctx.positions, x.dtype)  # [T, d]
        q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        o = attend(ctx, self.layer, q, k, self.v_norm(v), 1.0, window=self.window)
        return self.o_proj(o.reshape(t, -1))
