"""Llama 4 text attention: RoPE layers with chunked local attention and L2 q/k norm, NoPE
layers with full attention and query temperature tuning.

Owns the per-layer choice among those and the order HF applies them in (rope, then the
weightless q/k norm, then the temperature); projections and the attention core are
attention.py's. Mirrors transformers' Llama4TextAttention.
"""

from __future__ import annotations

from typing import Any

import torch

from moetier.layers.attention import Attention, attend
from moetier.layers.context import ForwardContext
from moetier.layers.mla import rope_complex

# Legend: T tokens, H query heads, Hkv KV heads, d head dim.


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama4TextL2Norm: RMS-normalize the last dim in float32, no weight, cast back."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(Attention):
    """GQA attention of one Llama 4 layer; `no_rope_layers[layer]` 1 = a RoPE layer.

    RoPE layers rotate channel pairs (2i, 2i+1) as complex numbers, L2-normalize q and k under
    use_qk_norm, and attend in chunks of attention_chunk_size positions when their layer type
    is chunked_attention. NoPE layers attend to the whole history; with attn_temperature_tuning
    their queries scale by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1.
    """

    def __init__(self, config: Any, layer: int) -> None:
        bias = bool(config.attention_bias)
        super().__init__(config, layer, bias=bias, o_bias=bias)
        self.use_rope = bool(config.no_rope_layers[layer])
        self.l2_qk = bool(config.use_qk_norm) and self.use_rope
        self.eps = float(config.rms_norm_eps)
        self.temperature: tuple[float, float] | None = None
        if config.attn_temperature_tuning and not self.use_rope:
            self.temperature = (float(config.floor_scale), float(config.attn_scale))
        layer_types = getattr(config, "layer_types", None) or []
        chunked = layer < len(layer_types) and layer_types[layer] == "chunked_attention"
        self.chunk: int | None = int(config.attention_chunk_size) if chunked else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)  # [T, H, d]
        k = self.k_proj(x).view(t, self.n_kv, self.head_dim)  # [T, Hkv, d]
        v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
        if self.use_rope:
            # HF keeps the rotation table complex64 whatever the model dtype.
            cos, sin = self.rotary(ctx.positions, torch.float32)  # [T, d]
            q, k = rope_complex(q, cos, sin), rope_complex(k, cos, sin)
        if self.l2_qk:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = ctx.positions.float()  # [T]: HF's past_seen_tokens + arange, per sequence
            scales = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        o = attend(ctx, self.layer, q, k, v, self.head_dim**-0.5, chunk=self.chunk)
        return self.o_proj(o.reshape(t, -1))
