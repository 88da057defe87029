"""Multi-head Latent Attention (DeepSeek-V2/V3): low-rank Q/KV projections and decoupled RoPE.

Owns the MLA projections, the rotary variant of each DeepSeek version and the softmax scale
(with the yarn mscale correction HF applies); attention itself is the shared `attend()` core.
The KV cache holds the compressed latent plus the rope key (kv_lora_rank + dr per token, ~71x
less than expanded per-head K/V for DeepSeek-V3), with kv_b_proj absorbed into q and output.
A step of fresh prompts only (nothing cached before them, no decode rows) may cache the same
latent but attend in the expanded form, as transformers computes it (`_attend_fresh`; see
`EXPANDED_FRESH` for where it is on).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import UnsupportedModelError
from moetier.layers.attention import attend
from moetier.layers.context import ForwardContext
from moetier.layers.norm import RMSNorm
from moetier.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters

# Legend: T tokens, H heads, r latent rank, dn/dr nope/rope dims of q and k, dq = dn + dr,
# dv value head dim.

# How the rope channels of q/k are rotated:
#   "complex"    V2: channel pairs (2i, 2i+1) as complex numbers times e^{i*theta}, in float32,
#                output stays interleaved;
#   "interleave" V3 with rope_interleave: pairs (2i, 2i+1) rotated, output de-interleaved
#                (evens then odds), i.e. rotate-half after the even/odd permutation;
#   "half"       V3 without rope_interleave: plain rotate-half.
ROPE_STYLES = ("complex", "interleave", "half")

# HF builds the MLA low-rank norms with the RMSNorm default eps, not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


# Switch: steps of fresh prompts attend in the expanded form (`_attend_fresh`), on by default:
# DeepSeek-V2-Lite (27 layers, bf16, every expert resident) prefills 2,048 tokens in 40.5 ms
# against 156.4 ms absorbed on an H100 (flash instead of SDPA's math kernel,
# bench/results/2026-12-07-mla-fresh-h100.md); on the CPU not slower
# (bench/results/2026-12-07-mla-fresh-cpu.md). MLA_EXPANDED_FRESH=0 in the environment (read
# at import) keeps every step absorbed.
EXPANDED_FRESH: bool = os.environ.get("MLA_EXPANDED_FRESH", "1") != "0"


def _expanded_fresh(x: torch.Tensor, ctx: ForwardContext) -> bool:
    """Whether this step attends in the expanded form: the switch is on,
    every sequence starts in the step, and the cache stores the latent exactly (a lossy KV
    format's prompt attends over what the cache gives back, as every other layer's does)."""
    return EXPANDED_FRESH and _all_fresh(ctx) and ctx.kv.exact(x.dtype)


def _all_fresh(ctx: ForwardContext) -> bool:
    """Every sequence of the step starts in it (no cached tokens before it, no decode rows)."""
    return ctx.kv_batch.decode_rows is None and all(span.past == 0 for span in ctx.spans)


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config: Any, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a non-default rope type."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim:
        m = yarn_mscale(params["factor"], mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, h, dr] rotated as complex pairs by float32 cos/sin [T, dr] (HF V2 apply_rotary_emb)."""
    half = cos.shape[-1] // 2
    freqs = torch.complex(cos[:, :half], sin[:, :half])[:, None, :]  # [T, 1, dr/2]
    xc = torch.view_as_complex(x.float().contiguous().reshape(*x.shape[:-1], -1, 2))  # [T, h, dr/2]
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


def rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, h, dr] with interleaved pairs -> rotated, evens then odds; HF's V3 interleave."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, dr/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    """DeepSeek MLA with HF module names (q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a_*...).

    `latent_cache` (default on) caches the compressed latent and attends in the absorbed form;
    off, the cache holds K/V expanded per head (the reference form, more memory).
    """

    latent_cache: bool = True

    def __init__(self, config: Any, layer: int, rope_style: str) -> None:
        super().__init__()
        if rope_style not in ROPE_STYLES:
            raise UnsupportedModelError(f"MLA rope style {rope_style!r} not in {ROPE_STYLES}")
        self.layer, self.rope_style = layer, rope_style
        self.n_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.dn, self.dr = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.dv = config.v_head_dim
        self.dq = self.dn + self.dr
        d, h = config.hidden_size, self.n_heads
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * self.dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * self.dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(h * self.dv, d, bias=bias)
        self.scale = mla_softmax_scale(config, self.dq)
        self.rotary = RotaryEmbedding(config, self.dr)

    def _rope(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, dr], k [T, 1, dr] -> both rotated, in the layout of this version."""
        if self.rope_style == "complex":
            # V2 keeps the rotation table complex64 whatever the model dtype.
            cos, sin = self.rotary(positions, torch.float32)  # [T, dr]
            return rope_complex(q, cos, sin), rope_complex(k, cos, sin)
        cos, sin = self.rotary(positions, q.dtype)
        if self.rope_style == "interleave":
            return rope_interleave(q, cos, sin), rope_interleave(k, cos, sin)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.n_heads, self.dq)  # [T, H, dq]
        q_nope, q_rot = q.split([self.dn, self.dr], dim=-1)  # [T, H, dn], [T, H, dr]
        ckv = self.kv_a_proj_with_mqa(x)  # [T, r + dr]
        latent, k_rot = ckv.split([self.kv_lora_rank, self.dr], dim=-1)  # [T, r], [T, dr]
        q_rot, k_rot = self._rope(q_rot, k_rot.view(t, 1, self.dr), ctx.positions)  # k: [T, 1, dr]
        latent = self.kv_a_layernorm(latent)  # [T, r]
        if self.latent_cache and _expanded_fresh(x, ctx):
            o = self._attend_fresh(ctx, q_nope, q_rot, latent, k_rot)
        elif self.latent_cache:
            o = self._attend_latent(ctx, q_nope, q_rot, latent, k_rot)
        else:
            kv = self.kv_b_proj(latent).view(t, self.n_heads, self.dn + self.dv)
            k_nope, v = kv.split([self.dn, self.dv], dim=-1)  # [T, H, dn], [T, H, dv]
            q = torch.cat([q_nope, q_rot], dim=-1)  # [T, H, dq]
            # The rope key is shared by all heads (the "mqa" part of kv_a_proj_with_mqa).
            k = torch.cat([k_nope, k_rot.expand(t, self.n_heads, self.dr)], dim=-1)  # [T, H, dq]
            o = attend(ctx, self.layer, q, k, v, self.scale)  # [T, H, dv]
        return self.o_proj(o.reshape(t, -1))

    def _attend_fresh(
        self,
        ctx: ForwardContext,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of a step whose every sequence starts in it (`_all_fresh`): the latent
        and rope key are cached as `_attend_latent` caches them, and each prompt attends to its
        own keys in the expanded form (per-head keys and values from kv_b_proj): heads of dq
        channels instead of r + dr, so SDPA's flash kernel serves it on CUDA (values padded to
        dq), where the absorbed form's 576-channel heads over one shared key head leave SDPA
        its math kernel. Same arguments and result as `_attend_latent`; no host sync.
        """
        t, r = latent.shape
        h = self.n_heads
        cached = torch.cat([latent.view(t, 1, r), k_rot], dim=-1)  # [T, 1, r + dr]
        ctx.kv.write(self.layer, cached, None, ctx.kv_batch.slot_mapping)
        kv = self.kv_b_proj(latent).view(t, h, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)  # [T, H, dn], [T, H, dv]
        q = torch.cat([q_nope, q_rot], dim=-1)  # [T, H, dq]
        k = torch.cat([k_nope, k_rot.expand(t, h, self.dr)], dim=-1)  # [T, H, dq]
        pad = q.is_cuda and self.dv < self.dq  # flash wants one head size for q, k and v
        if pad:
            v = F.pad(v, (0, self.dq - self.dv))  # [T, H, dq]
        o = q.new_empty(t, h, v.shape[-1])
        for span in ctx.spans:
            rows = slice(span.start, span.end)
            qs, ks, vs = (a[rows].transpose(0, 1).unsqueeze(0) for a in (q, k, v))  # [1, H, n, *]
            att = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            o[rows] = att[0].transpose(0, 1)
        return o[..., : self.dv] if pad else o

    def _attend_latent(
        self,
        ctx: ForwardContext,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
    ) -> torch.Tensor:
        """Attention over the cached latent: kv_b_proj's key half is absorbed into the query
        and its value half applied after attention, so the cache holds [latent, rope key]
        (r + dr per token, one shared head) instead of H * (dq + dv).

        q_nope [T, H, dn], q_rot [T, H, dr], latent [T, r] (normed), k_rot [T, 1, dr] ->
        [T, H, dv]. q.k and the softmax scale are those of the expanded form.
        """
        t, r = latent.shape
        w = self.kv_b_proj.weight.view(self.n_heads, self.dn + self.dv, r)
        w_uk, w_uv = w[:, : self.dn], w[:, self.dn :]  # [H, dn, r], [H, dv, r]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, r]
        q = torch.cat([q_lat, q_rot], dim=-1)  # [T, H, r + dr]
        k = torch.cat([latent.view(t, 1, r), k_rot], dim=-1)  # [T, 1, r + dr]
        o_lat = attend(ctx, self.layer, q, k, None, self.scale, v_dim=r)  # [T, H, r]
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)  # [T, H, dv]
