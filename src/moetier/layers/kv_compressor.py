"""DeepSeek-V4's KV compressors and the lightning indexer: compressed KV entries, one per window
of `rate` tokens, rebuilt from per-token projections kept in the paged KV cache.

`Compressor` owns the projections whose per-token outputs (kv and gate logits, `project`) the
attention stores beside its own key, and turns a sequence's stored rows into entries
(`entries`): a softmax-gated sum over each closed window (HCA), or over the window and the
previous one (CSA's overlapping series Ca / Cb), RMS-normed and rotated at the window's first
position. `Indexer` (CSA only) scores a sequence's queries against its own compressed keys and
picks the top `index_topk` entries each query attends to. Neither holds per-sequence state:
everything derives from the cached rows, so chunked prefill, preemption (recompute) and prefix
caching see the same entries as one full prefill. Mirrors transformers' DeepseekV4HCACompressor,
DeepseekV4CSACompressor and DeepseekV4Indexer (op for op, so top-k picks agree).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.norm import Float32RMSNorm
from moetier.layers.rotary import RotaryEmbedding

# Legend: T tokens, L a sequence's cached tokens, W closed windows (entries), m rate,
# d entry dim, c series per token (2 with overlap, else 1), n a span's queries, h index heads.


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's interleaved rope on the trailing channels of x: cos/sin hold one value per channel
    pair (shaped to broadcast against x's leading dims), channels (2i, 2i+1) rotate together,
    in float32, cast back; the leading (nope) channels pass through (HF apply_rotary_pos_emb)."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


def rope_table(
    rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, rd/2] of `rotary`'s inverse frequencies at int positions [N], in dtype."""
    if rotary.inv_freq.device != positions.device:
        rotary.inv_freq = rotary.inv_freq.to(positions.device)
    freqs = positions[:, None].float() * rotary.inv_freq[None, :]
    return (freqs.cos() * rotary.scaling).to(dtype), (freqs.sin() * rotary.scaling).to(dtype)


class Compressor(nn.Module):
    """One compressor (`compressor.*` on disk: wkv, wgate, ape, norm)."""

    ape: torch.Tensor

    def __init__(
        self, config: Any, dim: int, rate: int, overlap: bool, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        c = 2 if overlap else 1
        self.wkv = nn.Linear(config.hidden_size, c * dim, bias=False)
        self.wgate = nn.Linear(config.hidden_size, c * dim, bias=False)
        # the per-slot gate bias (HF position_bias), float32 as HF keeps it
        self.register_buffer("ape", torch.empty(rate, c * dim, dtype=torch.float32))
        self.norm = Float32RMSNorm(dim, config.rms_norm_eps)
        self.rotary = rotary
        self.width = 2 * c * dim  # channels this compressor adds to a token's cached row

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the per-token row part [T, 2cd]: kv, then raw gate logits."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def entries(self, rows: torch.Tensor, windows: int) -> torch.Tensor:
        """rows [L, 2cd] of one sequence (its tokens 0 .. L-1) -> entries [W, d] of its first
        `windows` closed windows, rotated at positions w * rate."""
        m, d, c = self.rate, self.dim, 2 if self.overlap else 1
        kv, gate = rows[: windows * m].split(c * d, dim=-1)
        kv = kv.view(windows, m, c * d)  # [W, m, cd]
        gate = gate.view(windows, m, c * d) + self.ape  # [W, m, cd], float32 with the bias
        if self.overlap:
            # Entry w: window w-1's Ca half (first d channels) then window w's Cb half; window
            # 0 has no predecessor: zero kv, -inf gate (softmax weight 0).
            wide_kv = kv.new_zeros((windows, 2 * m, d))
            wide_gate = gate.new_full((windows, 2 * m, d), float("-inf"))
            wide_kv[:, m:], wide_gate[:, m:] = kv[..., d:], gate[..., d:]
            if windows > 1:
                wide_kv[1:, :m], wide_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
            kv, gate = wide_kv, wide_gate
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        out = self.norm(pooled)  # [W, d]
        positions = torch.arange(windows, device=rows.device) * m
        cos, sin = rope_table(self.rotary, positions, out.dtype)
        return rope_tail(out, cos, sin)


class Indexer(nn.Module):
    """CSA's lightning indexer (`indexer.*` on disk: wq_b, weights_proj, compressor.*)."""

    def __init__(self, config: Any, rate: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.heads, self.dim = int(config.index_n_heads), int(config.index_head_dim)
        self.topk, self.rate = int(config.index_topk), rate
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(config, self.dim, rate, True, rotary)

    def select(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: torch.Tensor,
        windows: int,
        threshold: torch.Tensor,
    ) -> torch.Tensor:
        """One span: x [n, D], q_residual [n, r], its compress rope cos/sin [n, rd/2], the
        sequence's indexer rows [L, 4 d_I], `windows` closed windows and each query's count of
        visible entries threshold [n, 1] -> bool [n, W]: the entries each query attends to."""
        n = x.shape[0]
        keys = self.compressor.entries(rows, windows)  # [W, dI]
        q = self.wq_b(q_residual).view(n, self.heads, self.dim)
        q = rope_tail(q, cos[:, None], sin[:, None])  # [n, h, dI]
        scores = F.relu(torch.matmul(q.float(), keys.float().t())) * self.dim**-0.5  # [n, h, W]
        weights = self.weights_proj(x).float() * self.heads**-0.5  # [n, h]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [n, W]
        entry = torch.arange(windows, device=x.device)[None, :]  # [1, W]
        scores = scores.masked_fill(entry >= threshold, float("-inf"))
        top = scores.topk(min(self.topk, windows), dim=-1).indices  # [n, k]
        # a pick past the query's visible entries (fewer visible than k) selects nothing
        top = torch.where(top < threshold, top, torch.full_like(top, windows))
        chosen = torch.zeros(n, windows + 1, dtype=torch.bool, device=x.device)
        chosen.scatter_(1, top, True)
        return chosen[:, :windows]
