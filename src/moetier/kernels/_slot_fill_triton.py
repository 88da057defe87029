"""Triton kernel behind kernels/slot_fill.py: one program per (row to fill, chunk of words)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fill(host_ptr, pool_ptr, src_ptr, dst_ptr, ROW, HOST_STRIDE, POOL_STRIDE,
          BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(src_ptr + i)
    if s < 0:
        return
    d = tl.load(dst_ptr + i)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = offs < ROW
    v = tl.load(host_ptr + s * HOST_STRIDE + offs, mask=m)
    tl.store(pool_ptr + d * POOL_STRIDE + offs, v, mask=m)


def fill_slots_triton(
    host: torch.Tensor,
    pool: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    block: int,
    num_warps: int = 4,
) -> None:
    row = pool.shape[1]
    grid = (src.numel(), triton.cdiv(row, block))
    _fill[grid](host, pool, src, dst, row, host.stride(0), pool.stride(0), BLOCK=block,
                num_warps=num_warps)  # fmt: skip
