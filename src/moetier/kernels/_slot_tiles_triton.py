"""The expert kernels' one way to read a weight tile from a slot in place (kernels/slot_layout.py):
dense in the model dtype, FP8 e4m3 times its block's float32 scale, a GGUF block type (Q8_0,
Q4_K, Q5_K, Q6_K) decoded as `gguf.quants.dequantize` does, or MXFP4 decoded as
weights/mxfp4.py does (E2M1 value x 2^(scale - 127)), operation for operation in float32.
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
def _fp4(n):
    """E2M1 nibbles n (int32, 0..15) as float32: weights/mxfp4.py's FP4_VALUES without a
    table. Magnitude in halves: m for exponent 0 (0, 1), else (2 + m) << (e - 1) (2..12)."""
    e = (n >> 1) & 0x03
    m = n & 0x01
    halves = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    mag = halves.to(tl.float32) * 0.5
    return tl.where(n >= 8, -mag, mag)  # -0.0 for nibble 8, as the table


@triton.jit
def _e8m0(s):
    """E8M0 scale bytes s (int32) as float32 2^(s - 127), built from its bits (exact, as the
    reference's ldexp: 0 is 2^-127, a subnormal; 255 is 2^128, inf)."""
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


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
        elif FMT == 6:  # MXFP4: byte c // 2 of the row (even column low), scale per 32
            q = (_byte(base, r * (COLS // 2) + c // 2) >> (4 * (c % 2))) & 0x0F
            return _fp4(q) * _e8m0(_byte(base, S_OFF + r * (COLS // 32) + c // 32))
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


@triton.jit
def _dot_q4k(base, r, x_row, k0, COLS, dt: tl.constexpr, FMT: tl.constexpr):
    """Q4_K / Q5_K: one super-block (256 columns from k0) of each row r [BN] against x."""
    w_lo, w_hi = _q4k_rows(base, r, k0, COLS, dt, FMT)  # [BN, 4, 32]
    j = tl.arange(0, 4)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    x_lo = tl.load(x_row + k0 + 64 * j + lane).to(tl.float32)  # [1, 4, 32]
    x_hi = tl.load(x_row + k0 + 64 * j + 32 + lane).to(tl.float32)
    part = w_lo.to(tl.float32) * x_lo + w_hi.to(tl.float32) * x_hi
    return tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def _dot_q6k(base, r, x_row, k0, COLS, dt: tl.constexpr):
    """Q6_K: one super-block (256 columns from k0) of each row r [BN] against x."""
    w0, w1 = _q6k_rows(base, r, k0, COLS, dt)  # [BN, 2, 4, 16]
    h = tl.arange(0, 2)[None, :, None, None]
    g = tl.arange(0, 4)[None, None, :, None]
    s = tl.arange(0, 16)[None, None, None, :]
    col = k0 + 128 * h + 16 * g + s  # [1, 2, 4, 16]
    x0 = tl.load(x_row + col).to(tl.float32)
    x1 = tl.load(x_row + col + 64).to(tl.float32)
    part = w0.to(tl.float32) * x0 + w1.to(tl.float32) * x1
    return tl.sum(tl.sum(tl.sum(part, axis=3), axis=2), axis=1)


@triton.jit
def _dot_q8_0(base, r, x_row, k0, COLS, dt: tl.constexpr, BK: tl.constexpr):
    """Q8_0: BK columns from k0 (BK // 32 blocks, the last chunk masked) of rows r [BN]."""
    kb = tl.arange(0, BK // 32)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    col = k0 + 32 * kb + lane  # [1, NB, 32]
    cmask = col < COLS
    kbm = (k0 // 32 + kb) * 32 < COLS  # [1, NB, 1]
    blk = (r[:, None, None] * (COLS // 32) + k0 // 32 + kb) * 34  # [BN, NB, 1]
    q = tl.load((base + blk + 2 + lane).to(tl.pointer_type(tl.int8)), mask=cmask, other=0)
    d = tl.load((base + blk).to(tl.pointer_type(tl.float16)), mask=kbm, other=0.0)
    w = (q.to(tl.float32) * d.to(tl.float32)).to(dt).to(tl.float32)
    xv = tl.load(x_row + col, mask=cmask, other=0.0).to(tl.float32)
    return tl.sum(tl.sum(w * xv, axis=2), axis=1)


@triton.jit
def _fp4_bits(n):
    """E2M1 nibbles n (int32, 0..15) as float32 by building the bits: equal to `_fp4` for
    every nibble, -0.0 for 8 included (the sign is bit 3, moved to bit 31). Magnitude
    v = n & 7 (exponent e = v >> 1, mantissa m = v & 1): from v = 2 on 2^(e - 1) * (1 + m/2),
    whose bits are exponent e + 126 and mantissa bit 22 set by m: (2e + m + 252) << 22 =
    (v + 252) << 22; below that 0 (v = 0) or 0.5 (v = 1, 252 << 22), so (252 v) << 22."""
    v = n & 0x07
    mag = tl.where(v < 2, v * 252, v + 252) << 22
    return (mag | ((n & 0x08) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _dot_mxfp4(base, r, x_row, k0, COLS, S_OFF, dt: tl.constexpr, BK: tl.constexpr,
               WARPS: tl.constexpr):  # fmt: skip
    """MXFP4: BK columns from k0 (BK // 32 blocks, the last chunk masked) of rows r [BN]: each
    (row, block)'s 16 bytes as four little-endian int32 words, and its scale. Byte b of a block
    holds columns 2b (low nibble) and 2b + 1 (high), so nibble i of word j (bits 4i..4i+3) is
    column 8j + i: the tile of nibbles (word j, row, block, nibble i) meets x's 32 consecutive
    columns of each block as loaded, with no gather. The 16-byte word loads stay aligned: a
    matrix starts 16-byte aligned in its slot (weights/formats.py ALIGN; the slot row stride
    is a multiple of it) and (row, block) starts 16 (row * COLS / 32 + block) bytes in. Masks
    are per block: rows hold whole blocks, so a block lies in the row or past it.

    Layout: x's tile is broadcast over the rows before its load, so that Triton lays it out as
    the weights (a thread's x beside its words), with no shared-memory conversion and barrier
    between the loads and the math. With a (row, block) for each of the launch's 32 x WARPS
    threads the word index is the outer dimension, so each thread holds whole blocks (one
    16-byte load of words); with fewer (a few rows over several warps) the rows are, so the
    warps split rows rather than words and no reduction crosses warps."""
    word_major: tl.constexpr = r.shape[0] * (BK // 32) >= 32 * WARPS
    if word_major:
        word = tl.arange(0, 4)[:, None, None]  # [4, 1, 1]
        rb = r[None, :, None]  # [1, BN, 1]
    else:
        word = tl.arange(0, 4)[None, :, None]  # [1, 4, 1]
        rb = r[:, None, None]  # [BN, 1, 1]
    kb = tl.arange(0, BK // 32)[None, None, :]  # [1, 1, NB]
    kbm = (k0 // 32 + kb) * 32 < COLS  # [1, 1, NB]
    blk = rb * (COLS // 32) + k0 // 32 + kb  # the (row, block) index, [1, BN, NB] / [BN, 1, NB]
    w = tl.load(base.to(tl.pointer_type(tl.int32)) + 4 * blk + word, mask=kbm, other=0)
    shift = (4 * tl.arange(0, 8))[None, None, None, :]
    q = (w[:, :, :, None] >> shift) & 0x0F  # [4, BN, NB, 8] / [BN, 4, NB, 8]
    s = tl.load(base + S_OFF + blk, mask=kbm, other=127).to(tl.int32)
    wt = _fp4_bits(q) * _e8m0(s)[:, :, :, None]
    if dt != tl.bfloat16:  # (a no-op for float32)
        # rounding to bf16 would change nothing, so it is left out: a product is E2M1's two
        # significant bits times a power of two within float32's (bf16's) exponent range, or
        # at least 0.5 x 2^-127 = 2^-128, a bf16 subnormal (they reach down to 2^-133)
        wt = wt.to(dt).to(tl.float32)
    col = (k0 + 32 * kb + 8 * word)[:, :, :, None] + tl.arange(0, 8)[None, None, None, :]
    xv = tl.load(
        tl.broadcast_to(x_row + col, q.shape),  # (see Layout above)
        mask=tl.broadcast_to(kbm[:, :, :, None], q.shape),
        other=0.0,
    ).to(tl.float32)
    part = tl.sum(tl.sum(wt * xv, axis=3), axis=0 if word_major else 1)  # [BN, NB]
    return tl.sum(part, axis=1)


@triton.jit
def dot_chunk(base, rows, rmask, x_row, k0, COLS, S_OFF, BR, BC: tl.constexpr,
              dt: tl.constexpr, FMT: tl.constexpr, BK: tl.constexpr,
              WARPS: tl.constexpr):  # fmt: skip
    """[BN] float32: each row of the [*, COLS] matrix at `base` (rows [BN], rmask) dotted with
    x_row[k0 : k0 + BK], the weights decoded as `weight_tile` does and rounded to `dt` first.
    Compressed formats load their block fields once per (row, block), not per element: GGUF
    K-quants need BK = 256 (one super-block per row), Q8_0 and MXFP4 a multiple of 32 and FP8
    a BK that divides BC (one scale per row); other FP8 blocks take `weight_tile`. WARPS: the
    launch's num_warps, by which MXFP4 arranges its tile (its order of sums, no weight)."""
    if FMT == 0 or (FMT == 1 and BC % BK != 0):
        cols = k0 + tl.arange(0, BK)
        cmask = cols < COLS
        xv = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
        m2 = rmask[:, None] & cmask[None, :]
        w = weight_tile(base, rows[:, None], cols[None, :], m2, COLS, S_OFF, BR, BC, FMT)
        return tl.sum(w.to(dt).to(tl.float32) * xv[None, :], axis=1)
    elif FMT == 1:  # FP8 e4m3: the chunk lies in one column block, one scale per row
        cols = k0 + tl.arange(0, BK)
        cmask = cols < COLS
        xv = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
        m2 = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * COLS + cols[None, :]
        v = tl.load(base.to(tl.pointer_type(tl.float8e4nv)) + offs, mask=m2, other=0.0)
        scale_cols = (COLS + BC - 1) // BC
        s_idx = (rows // BR).to(tl.int64) * scale_cols + k0 // BC  # [BN]
        s = tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + s_idx, mask=rmask, other=0.0)
        w = (v.to(tl.float32) * s[:, None]).to(dt).to(tl.float32)
        return tl.sum(w * xv[None, :], axis=1)
    else:
        r = tl.where(rmask, rows, 0).to(tl.int64)
        if FMT == 2:
            return _dot_q8_0(base, r, x_row, k0, COLS, dt, BK)
        elif FMT == 6:
            return _dot_mxfp4(base, r, x_row, k0, COLS, S_OFF, dt, BK, WARPS)
        elif FMT == 5:
            return _dot_q6k(base, r, x_row, k0, COLS, dt)
        else:
            return _dot_q4k(base, r, x_row, k0, COLS, dt, FMT)


@triton.jit
def _q4k_rows(base, r, k0, COLS, dt: tl.constexpr, FMT: tl.constexpr):
    """Q4_K / Q5_K super-block rows decoded: (w_lo, w_hi) [BN, 4, 32] in dt, the elements
    64j + lane and 64j + 32 + lane of the 256 columns from k0: the two nibbles of qs byte
    32j + lane, scale and min of sub-blocks 2j and 2j + 1."""
    ts = 144 if FMT == 3 else 176
    qs = 16 if FMT == 3 else 48
    blk = ((r * (COLS // 256) + k0 // 256) * ts)[:, None, None]
    j = tl.arange(0, 4)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    qb = tl.load(base + blk + qs + 32 * j + lane).to(tl.int32)
    q_lo = qb & 0x0F
    q_hi = qb >> 4
    if FMT == 4:
        qh = tl.load(base + blk + 16 + lane).to(tl.int32)
        q_lo = q_lo | (((qh >> (2 * j)) & 0x01) << 4)
        q_hi = q_hi | (((qh >> (2 * j + 1)) & 0x01) << 4)
    sc_lo, mn_lo = _k_scale_min(base, blk, 2 * j)
    sc_hi, mn_hi = _k_scale_min(base, blk, 2 * j + 1)
    d = _f16_at(base, blk)
    dmin = _f16_at(base, blk + 2)
    w_lo = ((d * sc_lo) * q_lo.to(tl.float32) - dmin * mn_lo).to(dt)
    w_hi = ((d * sc_hi) * q_hi.to(tl.float32) - dmin * mn_hi).to(dt)
    return w_lo, w_hi


@triton.jit
def _q6k_rows(base, r, k0, COLS, dt: tl.constexpr):
    """Q6_K super-block rows decoded: (w0, w1) [BN, 2, 4, 16] in dt, the elements
    128h + 16g + s and 128h + 64 + 16g + s of the 256 columns from k0. Element
    i = 128h + 64a + 32b + l, with m = 32b + l = 16g + s: ql byte 64h + m (nibble a), qh byte
    32h + l (bits 4a + 2b), scale 8h + 4a + g."""
    blk = ((r * (COLS // 256) + k0 // 256) * 210)[:, None, None, None]
    h = tl.arange(0, 2)[None, :, None, None]
    g = tl.arange(0, 4)[None, None, :, None]
    s = tl.arange(0, 16)[None, None, None, :]
    ql = tl.load(base + blk + 64 * h + 16 * g + s).to(tl.int32)
    qh = tl.load(base + blk + 128 + 32 * h + 16 * (g % 2) + s).to(tl.int32)
    shift = 2 * (g // 2)
    q0 = ((ql & 0x0F) | (((qh >> shift) & 0x03) << 4)) - 32
    q1 = ((ql >> 4) | (((qh >> (shift + 4)) & 0x03) << 4)) - 32
    sc_ptr = (base + blk + 192 + 8 * h + g).to(tl.pointer_type(tl.int8))
    d = _f16_at(base, blk + 208)
    w0 = ((d * tl.load(sc_ptr).to(tl.float32)) * q0.to(tl.float32)).to(dt)
    w1 = ((d * tl.load(sc_ptr + 4).to(tl.float32)) * q1.to(tl.float32)).to(dt)
    return w0, w1


@triton.jit
def weight_tile_kn(base, rows, rmask, k0, COLS, S_OFF, BR, BC: tl.constexpr,
                   dt: tl.constexpr, FMT: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """[BK, BN] in dt: the weights of rows [BN] (rmask) at columns k0 .. k0 + BK of the
    [*, COLS] matrix at `base`, decoded as `weight_tile` does, for a tensor-core dot. Block
    fields load once per (row, block): FP8 with a BK that divides BC takes one scale per row;
    GGUF and MXFP4 take one 32-column sub-block (BK = 32) with its scale (two for Q6_K) per
    row."""
    if FMT == 0 or (FMT == 1 and BC % BK != 0):
        cols = k0 + tl.arange(0, BK)
        m2 = (cols < COLS)[:, None] & rmask[None, :]
        w = weight_tile(base, rows[None, :], cols[:, None], m2, COLS, S_OFF, BR, BC, FMT)
        return w.to(dt)
    elif FMT == 1:
        cols = k0 + tl.arange(0, BK)
        m2 = (cols < COLS)[:, None] & rmask[None, :]
        offs = rows[None, :].to(tl.int64) * COLS + cols[:, None]
        v = tl.load(base.to(tl.pointer_type(tl.float8e4nv)) + offs, mask=m2, other=0.0)
        scale_cols = (COLS + BC - 1) // BC
        s_idx = (rows // BR).to(tl.int64) * scale_cols + k0 // BC  # [BN]
        s = tl.load((base + S_OFF).to(tl.pointer_type(tl.float32)) + s_idx, mask=rmask, other=0.0)
        return (v.to(tl.float32) * s[None, :]).to(dt)
    else:  # GGUF, MXFP4: the rows span whole blocks, so k0 < COLS needs no column mask
        r = tl.where(rmask, rows, 0).to(tl.int64)
        lane = tl.arange(0, 32)[:, None]  # [32, 1]
        if FMT == 6:  # MXFP4: lane's byte lane // 2 of the block, its nibble by parity
            byte = _byte(base, (r * (COLS // 2) + k0 // 2)[None, :] + lane // 2)  # [32, BN]
            q = (byte >> (4 * (lane % 2))) & 0x0F
            s = _byte(base, S_OFF + r * (COLS // 32) + k0 // 32)[None, :]  # [1, BN]
            return (_fp4(q) * _e8m0(s)).to(dt)
        if FMT == 2:  # Q8_0
            blk = ((r * (COLS // 32) + k0 // 32) * 34)[None, :]  # [1, BN]
            q = tl.load((base + blk + 2 + lane).to(tl.pointer_type(tl.int8))).to(tl.float32)
            return (q * _f16_at(base, blk)).to(dt)
        sub = (k0 % 256) // 32  # the super-block's 32-column sub-block
        if FMT == 5:  # Q6_K: sub = 4h + 2a + b, elements 128h + 64a + 32b + lane
            blk = ((r * (COLS // 256) + k0 // 256) * 210)[None, :]
            h = sub // 4
            a = (sub // 2) % 2
            b = sub % 2
            ql = _byte(base, blk + 64 * h + 32 * b + lane)  # [32, BN]
            qh = _byte(base, blk + 128 + 32 * h + lane)
            q = (((ql >> (4 * a)) & 0x0F) | (((qh >> (4 * a + 2 * b)) & 0x03) << 4)) - 32
            sc_ptr = (base + blk + 192 + 8 * h + 4 * a + 2 * b).to(tl.pointer_type(tl.int8))
            sc = tl.where(lane < 16, tl.load(sc_ptr), tl.load(sc_ptr + 1)).to(tl.float32)
            return ((_f16_at(base, blk + 208) * sc) * q.to(tl.float32)).to(dt)
        else:  # Q4_K / Q5_K: sub = 2j + half, elements 64j + 32 half + lane
            ts = 144 if FMT == 3 else 176
            qs = 16 if FMT == 3 else 48
            blk = ((r * (COLS // 256) + k0 // 256) * ts)[None, :]
            q = (_byte(base, blk + qs + 32 * (sub // 2) + lane) >> (4 * (sub % 2))) & 0x0F
            if FMT == 4:
                q = q | (((_byte(base, blk + 16 + lane) >> sub) & 0x01) << 4)
            sc, mn = _k_scale_min(base, blk, sub)  # [1, BN]
            d = _f16_at(base, blk)
            dmin = _f16_at(base, blk + 2)
            return ((d * sc) * q.to(tl.float32) - dmin * mn).to(dt)
