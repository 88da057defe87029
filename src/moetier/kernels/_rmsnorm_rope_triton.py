"""Triton kernels behind kernels/rmsnorm_rope.py: one launch for an RMSNorm, one for a rotary
application, instead of the six to eight elementwise kernels eager PyTorch launches for each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm(x_ptr, w_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / dim
    dt = out_ptr.dtype.element_ty
    h = (x * (1.0 / tl.sqrt(var + eps))).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (w * h).to(dt), mask=mask)


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, dim, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (token, head) row
    t = row // heads
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    half = dim // 2
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    partner = tl.where(cols < half, cols + half, cols - half)
    xr = tl.load(x_ptr + row * dim + partner, mask=mask, other=0.0).to(tl.float32)
    xr = tl.where(cols < half, -xr, xr)  # rotate_half
    c = tl.load(cos_ptr + t * dim + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * dim + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    a = (x * c).to(dt).to(tl.float32)
    b = (xr * s).to(dt).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (a + b).to(dt), mask=mask)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.result_type(weight, xc), device=x.device)
    rows = xc.numel() // dim
    _rmsnorm[(rows,)](xc, weight, out, dim, eps, BLOCK=triton.next_power_of_2(dim))
    return out


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, heads, dim = x.shape
    xc = x.contiguous()
    out = torch.empty_like(xc)
    _rope[(t * heads,)](
        xc,
        cos.contiguous(),
        sin.contiguous(),
        out,
        heads,
        dim,
        BLOCK=triton.next_power_of_2(dim),
    )
    return out
