"""Attention over a flattened batch: standard GQA projections and the shared attention core.

The core appends this step's K/V to the kv store and attends each sequence's queries to its
whole history with a causal offset. It owns no weights of MLA (see mla.py, which reuses the core).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.context import ForwardContext
from moetier.layers.norm import RMSNorm
from moetier.layers.rotary import RotaryEmbedding

# Legend: T tokens in the step, H query heads, Hkv KV heads, L cached tokens, d head dim.


def attend(
    ctx: ForwardContext,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, dk], k [T, Hkv, dk], v [T, Hkv, dv] -> [T, H, dv], per-sequence causal."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    groups = q.shape[1] // k.shape[1]
    for span in ctx.spans:
        k_all, v_all = ctx.kv.append(
            layer, span.seq_id, k[span.start : span.end], v[span.start : span.end]
        )
        qs = q[span.start : span.end].transpose(0, 1)  # [H, q, dk]
        ks = k_all.transpose(0, 1).repeat_interleave(groups, dim=0)  # [H, L, dk]
        vs = v_all.transpose(0, 1).repeat_interleave(groups, dim=0)  # [H, L, dv]
        n_q, n_kv = qs.shape[1], ks.shape[1]
        mask = None
        if n_q > 1:
            # query i sits at position past + i and sees keys 0 .. past + i
            rows = torch.arange(n_q, device=q.device)[:, None] + span.past
            mask = torch.arange(n_kv, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[span.start : span.end] = o.transpose(0, 1)
    return out


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional q/k bias and q/k norms.

    qk_norm: None, "head" (per-head RMSNorm, Qwen3) or "full" (RMSNorm over the whole
    projection, OLMoE). bias applies to q/k/v; o_bias to o_proj (Qwen3-MoE and OLMoE bias all four
    under `attention_bias`, Qwen2-MoE only q/k/v).
    """

    def __init__(
        self,
        config: Any,
        layer: int,
        bias: bool = False,
        qk_norm: str | None = None,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        d, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(self.n_heads * self.head_dim, eps)
            self.k_norm = RMSNorm(self.n_kv * self.head_dim, eps)
        self.clip_qkv = getattr(config, "clip_qkv", None)
        self.rotary = RotaryEmbedding(config, self.head_dim)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            # After the full-projection norms, as OLMoE does (it clamps the normed q/k).
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(t, self.n_heads, self.head_dim)  # [T, H, d]
        k = k.view(t, self.n_kv, self.head_dim)  # [T, Hkv, d]
        v = v.view(t, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rotary(ctx.positions, x.dtype)
        q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        o = attend(ctx, self.layer, q, k, v, self.head_dim**-0.5)
        return self.o_proj(o.reshape(t, -1))
