"""The expert kernels' one way to read a weight tile from a slot in place (kernels/slot_layout.py):
dense in the model dtype, FP8 e4m3 times its block's float32 scale, or a GGUF block type (Q8_0,
Q4_K, Q5_K, Q6_K) decoded as `gguf.quants.dequantize` does, operation for operation in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f16_at(base, off):
    """The little-endian fp16 at byte offsets `off` of `base` (a byte pointer), as float32."""
    return tl.load((base + off).to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _byte(base, off):
    return tl.load(base + off).to(tl.int32)


@triton.jit
def _k_scale_min(base, blk, sub):
    """Six-bit scale and min of sub-block `sub` (0..7) of the Q4_K/Q5_K super-block at byte
    `blk` (its 12 packed bytes start at blk + 4)."""
    lo = sub < 4
    k = tl.where(lo, sub, sub - 4)
    b_d = _byte(base, blk + 4 + k)  # bytes 0..3
    b_m = _byte(base, blk + 8 + k)  # bytes 4..7
    b_md = _byte(base, blk + 12 + k)  # bytes 8..11 (sub >= 4 only)
    sc = tl.where(lo, b_d & 0x3F, (b_md & 0x0F) | ((b_d >> 2) & 0x30))
    mn = tl.where(lo, b_m & 0x3F, (b_md >> 4) | ((b_m >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def weight_tile(base, rows, cols, mask, COLS, S_OFF, BR, BC, FMT: tl.constexpr):
    """Elements (rows, cols) (broadcasting index tensors) of the [*, COLS] matrix starting at
    `base` (a pool-element pointer), masked (masked-off elements may read anything in the slot
    but are never used). Dense: as stored. Else float32, for the caller to round to the model
    dtype (as the reference decodes to float32 and then rounds). FMT: kernels/slot_layout.py."""
    if FMT == 0:
        return tl.load(base + rows.to(tl.int64) * COLS + cols, mask=mask, other=0.0)
    elif FMT == 1:  # FP8 e4m3, float32 scale per BR x BC block after the values
        offs = rows.to(tl.int64) * COLS + cols
        v = tl.load(base.to(tl.pointer_type(tl.float8e4nv)) + offs, mask=mask, other=0.0)
        scale_cols = (COLS + BC - 1) // BC
        s_idx = (rows // BR).to(tl.int64) * scale_cols + cols // BC
        s = tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + s_idx, mask=mask, other=0.0)
        return v.to(tl.float32) * s
    else:
        r = tl.where(mask, rows, 0).to(tl.int64)
        c = tl.where(mask, cols, 0).to(tl.int64)
        if FMT == 2:  # Q8_0: 34-byte blocks of 32: fp16 d, 32 int8
            blk = (r * (COLS // 32) + c // 32) * 34
            q = tl.load((base + blk + 2 + c % 32).to(tl.pointer_type(tl.int8))).to(tl.float32)
            return q * _f16_at(base, blk)
        else:
            i = c % 256
            if FMT == 5:  # Q6_K: ql[128] qh[64] scales int8[16] d fp16 (210 bytes)
                blk = (r * (COLS // 256) + c // 256) * 210
                h = i // 128
                rem = i % 128
                lo = (_byte(base, blk + h * 64 + rem % 64) >> ((rem // 64) * 4)) & 0x0F
                hi = (_byte(base, blk + 128 + h * 32 + rem % 32) >> ((rem // 32) * 2)) & 0x03
                q = ((lo | (hi << 4)) - 32).to(tl.float32)
                sc = tl.load((base + blk + 192 + i // 16).to(tl.pointer_type(tl.int8)))
                return (_f16_at(base, blk + 208) * sc.to(tl.float32)) * q
            else:  # Q4_K (144 bytes) / Q5_K (176): fp16 d, dmin, 12 scale bytes, [qh[32]], qs
                ts = 144 if FMT == 3 else 176
                qs = 16 if FMT == 3 else 48
                blk = (r * (COLS // 256) + c // 256) * ts
                j = i // 64
                half = (i % 64) // 32
                q = (_byte(base, blk + qs + 32 * j + i % 32) >> (4 * half)) & 0x0F
                if FMT == 4:
                    q = q | (((_byte(base, blk + 16 + i % 32) >> (i // 32)) & 0x01) << 4)
                sc, mn = _k_scale_min(base, blk, 2 * j + half)
                d = _f16_at(base, blk)
                dmin = _f16_at(base, blk + 2)
                return (d * sc) * q.to(tl.float32) - dmin * mn
