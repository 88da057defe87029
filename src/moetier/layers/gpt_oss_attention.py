"""gpt-oss attention: GQA with q/k/v/o biases, attention sinks and per-layer sliding windows.

Layers of type `sliding_attention` (config.layer_types; every other layer in the released
models) attend to the last `sliding_window` positions, the others to the whole history. Each
head has a learned sink logit (`sinks` [H]) that joins its softmax denominator and attends to
nothing (attention.py `attend(sinks=...)`). Rope (yarn in the released configs) is
rotary.py's. Mirrors transformers' GptOssAttention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetier.layers.attention import Attention, attend
from moetier.layers.context import ForwardContext

# Legend: T tokens, H query heads, Hkv KV heads, d head dim.


class GptOssAttention(Attention):
    """Attention of gpt-oss layer `layer` (its window from `config.layer_types`)."""

    def __init__(self, config: Any, layer: int) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, layer, bias=bias, o_bias=bias)
        layer_types = getattr(config, "layer_types", None) or []
        sliding = layer < len(layer_types) and layer_types[layer] == "sliding_attention"
        window = getattr(config, "sliding_window", None)
        self.window: int | None = int(window) if sliding and window else None
        self.sinks = nn.Parameter(torch.empty(self.n_heads))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)  # [T, H, d]
        k = self.k_proj(x).view(t, self.n_kv, self.head_dim)  # [T, Hkv, d]
        v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
        cos, sin = self.rotary(ctx.positions, x.dtype)  # [T, d]
        q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        o = attend(
            ctx, self.layer, q, k, v, self.head_dim**-0.5, window=self.window, sinks=self.sinks
        )
        return self.o_proj(o.reshape(t, -1))
