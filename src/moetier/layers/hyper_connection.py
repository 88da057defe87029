"""Manifold-constrained hyper-connections (DeepSeek-V4's mHC): the residual kept as `hc_mult`
parallel streams, collapsed into one block input and expanded back from the block output.

Owns the per-token mixing weights (pre, post and the Sinkhorn-projected comb) and the final
collapse (`HyperHead`); computes nothing of the blocks themselves. Mirrors transformers'
DeepseekV4HyperConnection / DeepseekV4HyperHead op for op, in float32 as HF keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Legend: T tokens, N streams (hc_mult), D hidden.


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's DeepseekV4UnweightedRMSNorm: x * rsqrt(mean(x^2) + eps) in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One block's mHC: (pre, post, comb) from the N streams; named as on disk (`hc_attn_*` or
    `hc_ffn_*` of the decoder layer, held there as float32 buffers)."""

    def __init__(self, streams: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = streams, sinkhorn_iters, hc_eps, norm_eps

    def forward(
        self, h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, N, D], fn [(2+N)N, N*D], base [(2+N)N], scale [3] -> post [T, N], comb
        [T, N, N] (float32) and the collapsed block input [T, D] in h's dtype."""
        n = self.n
        flat = unweighted_rms(h.reshape(h.shape[0], -1).float(), self.norm_eps)
        mixed = F.linear(flat, fn.float())  # [T, (2+N)N]
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = base.split([n, n, n * n])
        pre_s, post_s, comb_s = scale.unbind(0)
        comb_w = comb_w.view(-1, n, n)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps  # [T, N]
        post = 2 * torch.sigmoid(post_w * post_s + post_b)  # [T, N]
        comb = torch.softmax(comb_w * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns, then (rows, columns) alternately -> doubly stochastic.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # [T, D]
        return post, comb, collapsed


def expand(
    h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The block output [T, D] back into N streams, plus the comb-mixed input streams h
    [T, N, D]: post[n] * out + sum_j comb[j, n] * h[j] (comb consumed transposed, as HF)."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), h
    )


class HyperHead(nn.Module):
    """The final collapse of the N streams before the model norm (`model.hc_head.*`)."""

    hc_fn: torch.Tensor
    hc_base: torch.Tensor
    hc_scale: torch.Tensor

    def __init__(self, streams: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        f32 = torch.float32
        self.register_buffer("hc_fn", torch.empty(streams, streams * hidden, dtype=f32))
        self.register_buffer("hc_base", torch.empty(streams, dtype=f32))
        self.register_buffer("hc_scale", torch.empty(1, dtype=f32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, N, D] -> [T, D]."""
        flat = unweighted_rms(h.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())  # [T, N]
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
