"""Gated full attention (Qwen3-Next, Qwen3.5): GQA with per-head zero-centred q/k norms,
partial rotary, and an output gate: q_proj yields each head's query and its gate side by side,
and the attention output is scaled by sigmoid(gate) before o_proj. Attends through the paged KV
cache (layers/attention.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetier.layers.attention import Attention, attend
from moetier.layers.context import ForwardContext
from moetier.layers.norm import OffsetRMSNorm

# Legend: T tokens, H query heads, Hkv KV heads, d head dim.


class GatedAttention(Attention):
    def __init__(self, config: Any, layer: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer, bias=bias, qk_norm="head", o_bias=bias, partial_rotary=True)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(d, 2 * self.n_heads * self.head_dim, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)  # [T, H, d]
        k = self.k_norm(self.k_proj(x).view(t, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
        cos, sin = self.rotary(ctx.positions, x.dtype)
        q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        o = attend(ctx, self.layer, q, k, v, self.head_dim**-0.5).reshape(t, -1)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, -1)))
