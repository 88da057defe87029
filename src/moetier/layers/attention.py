"""Attention over a flattened batch: standard GQA projections and the shared attention core.

The core writes this step's K/V into the paged KV cache and attends each sequence's queries to
its whole history (read through its block table) with a causal offset. It owns no weights of
MLA (see mla.py, which reuses the core).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.context import ForwardContext
from moetier.layers.norm import RMSNorm
from moetier.layers.rotary import RotaryEmbedding, rope_parameters

# Legend: T tokens in the step, H query heads, Hkv KV heads, L cached tokens, d head dim.


def attend(
    ctx: ForwardContext,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    scale: float,
    v_dim: int | None = None,
    chunk: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, dk], k [T, Hkv, dk], v [T, Hkv, dv] -> [T, H, dv], per-sequence causal.

    v None: values are the first `v_dim` channels of the keys (MLA's cached latent), so only
    the key pool is stored. chunk: local attention in chunks of that many positions (Llama 4's
    chunked layers): a query at position p sees keys from p // chunk * chunk to p only.
    window: sliding-window attention (Gemma's sliding layers, HF's `kv > q - window`): a query
    at position p sees keys from p - window + 1 to p only. The whole history stays cached.
    sinks [H]: attention sinks (gpt-oss), a learned logit per head that joins each query's
    softmax denominator and attends to nothing; computed by `_sink_attention`, not SDPA.

    Writes this step's K/V into the paged pools, then reads each sequence's history through its
    block table, in q's dtype (the cache casts or dequantizes what it stores, see
    engine/kv_cache.py): all one-token (decode) rows in one batched SDPA call with a padding
    mask, each longer chunk (prefill) in its own call with a causal mask offset by the cached
    tokens (a chunk with nothing cached before it is `is_causal`, SDPA's flash kernel; on
    the CPU a chunk with history takes `_attend_with_history`, two mask-free flash calls).
    GQA heads are grouped by SDPA (`enable_gqa`), never copied; no host sync.
    """
    meta = ctx.kv_batch
    ctx.kv.write(layer, k, v, meta.slot_mapping)
    dv = v.shape[-1] if v is not None else v_dim
    assert dv is not None

    def history(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [..., Hkv, d*] at slots, in q's dtype (the cache dequantizes or casts)."""
        kh, vh = ctx.kv.read(layer, slots, q.dtype)
        # MLA's values are the latent channels of the keys (contiguous, as SDPA had them
        # when they were gathered from a sliced pool)
        return kh, (kh[..., :dv].contiguous() if vh is None else vh)

    if len(meta.decode_spans) == len(ctx.spans):
        out: torch.Tensor | None = None  # every row is a decode row: no scatter needed
    else:
        out = q.new_empty(q.shape[0], q.shape[1], dv)
    if meta.decode_rows is not None:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        qd = q[meta.decode_rows].unsqueeze(2)  # [B, H, 1, dk]
        kd, vd = history(meta.decode_slots)  # [B, L, Hkv, d*]
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # [B, Hkv, L, d*]
        local = chunk is not None or window is not None
        mask = _local_decode_mask(ctx, chunk, window) if local else meta.decode_mask
        dec = _sdpa(qd, kd, vd, mask, scale, sinks).squeeze(2)  # [B, H, dv]
        if out is None:
            return dec
        out[meta.decode_rows] = dec
    assert out is not None
    for i, slots in (meta.span_slots or {}).items():
        span = ctx.spans[i]
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, dk]
        ks, vs = history(slots)  # [L, Hkv, d*]
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, d*]
        plain = chunk is None and window is None and sinks is None
        if span.past == 0 and plain:
            # A fresh prompt is plain causal attention: no mask lets SDPA pick its flash
            # kernel (native GQA) and skip the key blocks above the diagonal; a mask sends
            # CUDA to a slower kernel and makes the CPU's flash kernel visit every block.
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        elif span.past > 0 and plain and _split_history_ok(qs, vs):
            o = _attend_with_history(qs, ks, vs, span.past, scale)
        else:
            mask = _causal_mask(ctx, i, q.device, chunk, window)
            o = _sdpa(qs, ks, vs, mask, scale, sinks)
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [B, H, q, dk], k [B, Hkv, L, dk], v [B, Hkv, L, dv], bool mask broadcast to
    [B, H, q, L] -> [B, H, q, dv]: SDPA, or the sink-aware softmax when `sinks` is set."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return _sink_attention(q, k, v, mask, scale, sinks)


# The CPU flash kernel, which also returns each row's log-sum-exp (SDPA does not); None where
# this torch lacks it (the masked SDPA call then serves every chunk with history).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
SPLIT_HISTORY = True  # switch: chunks with history on the CPU split at the history (tests, A/B)


def _split_history_ok(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `_attend_with_history` serves this chunk: on the CPU, where the flash kernel
    (equal q/k/v head sizes; not MLA's narrower values) returns log-sum-exps."""
    return (
        SPLIT_HISTORY
        and _CPU_FLASH is not None
        and q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def _attend_with_history(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float
) -> torch.Tensor:
    """q [1, H, n, d], k/v [1, Hkv, past + n, d] -> [1, H, n, d]: causal attention of n new
    tokens at positions past .. past + n - 1, in two mask-free flash calls merged exactly.

    A [n, past + n] mask keeps the CPU flash kernel from skipping any key block and adds a
    mask pass to every one; yet every query sees all `past` cached keys, and among the new
    keys the mask is plain top-left causal. So: the history (no mask) and the new tokens
    (`is_causal`, upper blocks skipped), each with its rows' log-sum-exp, merged as
    o = sum_i o_i * exp(lse_i - logaddexp(lse_1, lse_2)) — the same softmax, summed in
    another order (float rounding apart, equal to the masked call). GQA is native. On the
    demo model (4,288 cached + 1,040 new tokens, 2 CPU cores) attention over 30 layers took
    3.3 s instead of 4.3 s; the rest is the history's own FLOPs (4.6x a fresh chunk's)."""
    assert _CPU_FLASH is not None
    o1, lse1 = _CPU_FLASH(q, k[:, :, :past], v[:, :, :past], 0.0, False, scale=scale)
    o2, lse2 = _CPU_FLASH(q, k[:, :, past:], v[:, :, past:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse1, lse2)  # [1, H, n] float32
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)  # [1, H, n, 1]
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(q.dtype)


_SINK_LOGITS = 1 << 26  # logits of one sink-attention chunk (256 MiB in float32)


def _sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention whose softmax denominator also holds exp(sinks[h]) (gpt-oss). The op order
    of transformers' eager gpt-oss attention (its only CPU path): scaled logits, masked, the
    sink column appended, the row max subtracted, softmax in q's dtype, the sink dropped.
    Queries go in chunks of at most `_SINK_LOGITS` logits (a long prompt's [H, q, L] would
    not fit); rows are independent, so chunking changes no value."""
    n_q, keys = q.shape[2], k.shape[2]
    step = max(1, _SINK_LOGITS // (q.shape[0] * q.shape[1] * keys))
    if n_q > step:
        per_row = mask.dim() >= 2 and mask.shape[-2] == n_q  # else broadcast over queries
        return torch.cat(
            [
                _sink_attention(
                    q[:, :, s : s + step],
                    k,
                    v,
                    mask[..., s : s + step, :] if per_row else mask,
                    scale,
                    sinks,
                )
                for s in range(0, n_q, step)
            ],
            dim=2,
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # each KV head serves `groups` consecutive query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B, H, q, L]
    logits = logits.masked_fill(~mask, float("-inf"))
    b, h, n_q, _ = logits.shape
    sink = sinks.to(logits.dtype).view(1, h, 1, 1).expand(b, h, n_q, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _causal_mask(
    ctx: ForwardContext,
    i: int,
    device: torch.device,
    chunk: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """[q, L] bool for span i: query j sits at position past + j and sees keys 0 .. past + j
    (with `chunk`, only those from the start of its chunk on; with `window`, only the last
    `window` of them)."""
    key = ("causal_mask", i, chunk, window)
    mask = ctx.memo.get(key)
    if mask is None:
        span = ctx.spans[i]
        n_q = span.end - span.start
        rows = torch.arange(n_q, device=device)[:, None] + span.past  # [q, 1]
        cols = torch.arange(span.past + n_q, device=device)[None, :]  # [1, L]
        mask = cols <= rows
        if chunk is not None:
            mask &= cols >= rows // chunk * chunk
        if window is not None:
            mask &= cols > rows - window
        ctx.memo[key] = mask
    return mask


def _local_decode_mask(ctx: ForwardContext, chunk: int | None, window: int | None) -> torch.Tensor:
    """The decode padding mask [B, 1, 1, L] keeping only keys in each query's own chunk (or
    its last `window` positions): column j of a decode row's slots is position j. Read from the
    positions tensor (no host sync)."""
    key = ("local_decode_mask", chunk, window)
    mask = ctx.memo.get(key)
    if mask is None:
        meta = ctx.kv_batch
        assert meta.decode_mask is not None and meta.decode_rows is not None
        pos = ctx.positions[meta.decode_rows]  # [B]
        start = pos // chunk * chunk if chunk is not None else torch.zeros_like(pos)
        if window is not None:
            start = torch.maximum(start, pos - window + 1)
        cols = torch.arange(meta.decode_mask.shape[-1], device=start.device)  # [L]
        mask = meta.decode_mask & (cols[None, :] >= start[:, None])[:, None, None, :]
        ctx.memo[key] = mask
    return mask


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional q/k bias and q/k norms.

    qk_norm: None, "head" (per-head RMSNorm, Qwen3) or "full" (RMSNorm over the whole
    projection, OLMoE). bias applies to q/k/v; o_bias to o_proj (Qwen3-MoE and OLMoE bias all four
    under `attention_bias`, Qwen2-MoE only q/k/v). partial_rotary rotates only the first
    head_dim * partial_rotary_factor channels of each head (GLM-4.5). layer_type picks the
    rope settings of configs that key them by layer type (Gemma 4).
    """

    def __init__(
        self,
        config: Any,
        layer: int,
        bias: bool = False,
        qk_norm: str | None = None,
        o_bias: bool = False,
        partial_rotary: bool = False,
        layer_type: str | None = None,
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
        if qk_norm == "head":  # nn.Module: a family may bring its own norm (Gemma 4)
            self.q_norm: nn.Module = RMSNorm(self.head_dim, eps)
            self.k_norm: nn.Module = RMSNorm(self.head_dim, eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(self.n_heads * self.head_dim, eps)
            self.k_norm = RMSNorm(self.n_kv * self.head_dim, eps)
        self.clip_qkv = getattr(config, "clip_qkv", None)
        rotary_dim = self.head_dim
        if partial_rotary:
            factor = rope_parameters(config).get("partial_rotary_factor", 1.0)
            rotary_dim = int(self.head_dim * factor)
        self.rotary = RotaryEmbedding(config, rotary_dim, layer_type)

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
