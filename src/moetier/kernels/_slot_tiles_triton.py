"""The expert kernels' one way to read a weight tile from a slot in place (kernels/slot_layout.py):
dense in the model dtype, or FP8 e4m3 times its block's float32 scale."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def weight_tile(base, rows, cols, mask, COLS, S_OFF, BR, BC, FP8: tl.constexpr):
    """Elements (rows, cols) (broadcasting index tensors) of the [*, COLS] matrix starting at
    `base` (a pool-element pointer), masked. Dense: as stored. FP8: value x scale in float32,
    for the caller to round to the model dtype (as the reference dequantizes)."""
    offs = rows.to(tl.int64) * COLS + cols
    if FP8:
        v = tl.load(base.to(tl.pointer_type(tl.float8e4nv)) + offs, mask=mask, other=0.0)
        scale_cols = (COLS + BC - 1) // BC
        s_idx = (rows // BR).to(tl.int64) * scale_cols + cols // BC
        s = tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + s_idx, mask=mask, other=0.0)
        return v.to(tl.float32) * s
    else:
        return tl.load(base + offs, mask=mask, other=0.0)
