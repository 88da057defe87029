"""RMSNorm and rotary application as single kernels, with the eager PyTorch reference beside them.

Owns the math only; layers/norm.py and layers/rotary.py decide when to call the kernel (CUDA,
Triton present, the module's `fused` switch on). Rounding points equal the reference's, so a
bf16 result differs only where a float32 sum is accumulated in another order.
"""

from __future__ import annotations

import torch

from moetier.kernels.expert_ffn import kernel_ok

# Legend: T tokens, H heads, d head dim.


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalize in float32, cast back, then scale in the weight's dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] rotated by cos/sin [T, d] (rotate-half convention)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
    if fused and kernel_ok(x):
        from moetier.kernels._rmsnorm_rope_triton import rmsnorm_triton

        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_reference(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    if fused and x.dim() == 3 and kernel_ok(x):
        from moetier.kernels._rmsnorm_rope_triton import rope_triton

        return rope_triton(x, cos, sin)
    return rope_reference(x, cos, sin)
