"""MXFP4 slots read in place by the expert kernels: the per-element tile (`weight_tile`), the slot
kernel and the grouped kernel (Triton's interpreter on the CPU) equal the reference on the
codec's exact decode (weights/mxfp4.py) of random valid blocks and scales: several blocks per
row, row counts that are no multiple of the tile, a last reduction chunk that is partly past
the row's end."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.slot_layout import MXFP4, chunk_cols, slot_layout
from moetier.weights.formats import ExpertFormat, ExpertPacking, ExpertShape, get_codec
from moetier.weights.mxfp4 import random_encoded
from tests.unit.test_expert_ffn import _run_in_interpreter


def test_mxfp4_slot_layout() -> None:
    # gate [I, D], up [I, D], down [D, I]: blocks (rows x cols / 2 bytes) then the scales
    mx = get_codec("mxfp4")
    fmt = ExpertFormat(ExpertShape(160, 96), torch.bfloat16, (mx,) * 3)
    layouts = slot_layout(ExpertPacking({0: fmt, 1: fmt}))
    assert layouts is not None and layouts[0] == layouts[1]
    layout = layouts[0]
    part = 96 * 160 // 2 + 96 * 160 // 32  # 7680 block bytes + 480 scales (16-aligned)
    assert fmt.part_bytes == (part,) * 3
    assert (layout.up, layout.down, layout.scales) == (part, 2 * part, 96 * 160 // 2)
    assert layout.gate_up_format == layout.down_format == MXFP4
    assert chunk_cols(256, MXFP4, layout) == 256 and chunk_cols(16, MXFP4, layout) == 32
    mixed = ExpertFormat(fmt.shape, torch.bfloat16, (mx, mx, get_codec("gguf-q8_0")))
    assert slot_layout(ExpertPacking({0: mixed})) is None  # one scale offset serves all three


def test_random_encoded_decodes_to_the_asked_magnitude() -> None:
    g = torch.Generator().manual_seed(0)
    w = get_codec("mxfp4").decode(random_encoded(64, 256, 0.05, g), 64, 256, torch.float32)
    assert torch.isfinite(w).all() and 0.02 < w.pow(2).mean().sqrt().item() < 0.12


_MXFP4_KERNELS = """
import torch
import triton
import triton.language as tl
from moetier.kernels._expert_ffn_triton import FfnConfig, expert_ffn_triton
from moetier.kernels._grouped_ffn_triton import GroupedConfig, grouped_ffn_triton
from moetier.kernels._slot_tiles_triton import weight_tile
from moetier.kernels.expert_ffn import expert_ffn, expert_ffn_reference
from moetier.kernels.grouped_ffn import grouped_ffn, grouped_ffn_reference
from moetier.kernels.slot_layout import MXFP4, slot_layout
from moetier.weights.formats import ExpertFormat, ExpertPacking, ExpertShape, get_codec
from moetier.weights.mxfp4 import random_encoded

@triton.jit
def probe(base, out, R, C, S_OFF, BR: tl.constexpr, BC: tl.constexpr, FMT: tl.constexpr):
    rows = tl.arange(0, BR)[:, None]
    cols = tl.arange(0, BC)[None, :]
    m = (rows < R) & (cols < C)
    w = weight_tile(base, rows, cols, m, C, S_OFF, 1, 32, FMT)
    tl.store(out + rows * C + cols, w, mask=m)

g = torch.Generator().manual_seed(0)
codec = get_codec("mxfp4")
# the per-element decode (the fallback loaders'): every element of a [7, 96] matrix
raw = random_encoded(7, 96, 0.1, g)
out = torch.empty(7, 96)
probe[(1,)](raw, out, 7, 96, 7 * 96 // 2, BR=8, BC=128, FMT=MXFP4)
assert torch.equal(out, codec.decode(raw, 7, 96, torch.float32))

# D 160 = 5 blocks a gate/up row, I 96 = 3 a down row; tiles of 64 rows leave partial ones
d, i, s, e = 160, 96, 6, 6
for dtype in (torch.float32, torch.bfloat16):
    fmt = ExpertFormat(ExpertShape(d, i), dtype, (codec,) * 3)
    packing = ExpertPacking({0: fmt})
    layout = slot_layout(packing)[0]
    assert layout.gate_up_format == layout.down_format == MXFP4
    pool = torch.zeros(s, packing.numel, dtype=torch.uint8)
    dense = torch.empty(s, 3 * i * d, dtype=dtype)
    for slot in range(s):
        for part, (rows, cols) in zip(fmt.parts(pool[slot]), ((i, d), (i, d), (d, i))):
            part.copy_(random_encoded(rows, cols, 2.0 / cols**0.5, g))
        gate_up, down = fmt.split(pool[slot])
        dense[slot] = torch.cat([gate_up.flatten(), down.flatten()])
    # fp32: the decoded weights are exact, so against the reference; bf16: against the dense
    # kernel on the decoded pool (the interpreter's bf16 casts may land one ulp off)
    fp32 = dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-5) if fp32 else dict(rtol=2**-6, atol=2**-6)
    # slot kernel, decode-sized: the default launch shape (one 256-column chunk, masked past
    # the row) and 64-row tiles over 64-column chunks (several chunks, the last half masked)
    x = torch.randn(2, d, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(s, generator=g)[:3] for _ in range(2)]).sort(-1).values
    w = torch.rand(2, 3, generator=g)
    want = expert_ffn_reference(x, dense, slots, w, i)
    assert torch.equal(expert_ffn_reference(x, pool, slots, w, i, layout), want)
    ref = want if fp32 else expert_ffn(x, dense, slots, w, i)
    torch.testing.assert_close(expert_ffn(x, pool, slots, w, i, layout), ref, **tol)
    cfg = FfnConfig(64, 64, 4, 1, True, 64, 64, 4, 1)
    got = expert_ffn_triton(x, pool, slots.to(torch.int32), w, i, cfg, layout)
    torch.testing.assert_close(got, ref, **tol)
    # grouped kernel, prefill-sized, with a skipped pair (another wave's expert)
    x = torch.randn(9, d, generator=g).to(dtype)
    experts = torch.stack([torch.randperm(e, generator=g)[:3] for _ in range(9)]).sort(-1).values
    slots = experts.clone().to(torch.int32)
    slots[0, 1] = -1
    w = torch.rand(9, 3, generator=g)
    want = grouped_ffn_reference(x, dense, slots, w, i)
    assert torch.equal(grouped_ffn_reference(x, pool, slots, w, i, None, layout), want)
    ref = want if fp32 else grouped_ffn(x, dense, slots, w, i, e, experts=experts)
    got = grouped_ffn(x, pool, slots, w, i, e, experts=experts, layout=layout)
    torch.testing.assert_close(got, ref, **tol)
    cfg = GroupedConfig(16, 64, 64, 4, 1, 64, 64, 4, 1)
    got = grouped_ffn_triton(x, pool, slots, w, i, e, cfg=cfg, experts=experts, layout=layout)
    torch.testing.assert_close(got, ref, **tol)
print("ok")
"""


def test_mxfp4_kernels_match_reference_in_interpreter() -> None:
    """The slot kernel's and the grouped kernel's MXFP4 decodes against the reference."""
    pytest.importorskip("triton")
    _run_in_interpreter(_MXFP4_KERNELS)


_MXFP4_EXACT = """
import torch
import triton
import triton.language as tl
from moetier.kernels._slot_tiles_triton import dot_chunk
from moetier.kernels.slot_layout import MXFP4
from moetier.weights.mxfp4 import FP4_VALUES, MXFP4 as CODEC

@triton.jit
def column(base, eye, out, ROWS, COLS, S_OFF, BN: tl.constexpr, BK: tl.constexpr,
           WARPS: tl.constexpr):
    # program c: the rows' chunk holding column c against row c of the identity
    c = tl.program_id(0)
    rows = tl.arange(0, BN)
    k0 = (c // BK) * BK
    x = eye + c * COLS
    dt = eye.dtype.element_ty
    acc = dot_chunk(base, rows, rows < ROWS, x, k0, COLS, S_OFF, 1, 32, dt, MXFP4, BK, WARPS)
    tl.store(out + c * BN + rows, acc)

ROWS, G = 16, 17  # 17 blocks a row: 544 columns, the last 128-column chunk a quarter full
COLS = 32 * G
r = torch.arange(ROWS)[:, None, None]
t = torch.arange(G)[None, :, None]
j = torch.arange(16)[None, None, :]
# byte j of block (r, t): low nibble j, high nibble j + r + t (mod 16): every block holds each
# nibble in both halves, every row all 256 byte values; the scales run through 0..255 (and on)
blocks = (j | (((j + r + t) % 16) << 4)).to(torch.uint8)
scales = (torch.arange(ROWS * G) % 256).view(ROWS, G).to(torch.uint8)
raw = CODEC.encode(blocks, scales)
assert raw.numel() % 16 == 0 and set(blocks.flatten().tolist()) == set(range(256))

# the kernel's contract: the E2M1 value times the float32 scale 2^(s - 127), rounded to dt
nib = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).view(ROWS, G, 32).long()
e8m0 = torch.where(scales == 0, 2.0**-127, torch.exp2(scales.double() - 127)).float()
want_f32 = (torch.tensor(FP4_VALUES)[nib] * e8m0[..., None]).view(ROWS, COLS)
# ... which is the codec's decode except at scale 255 (NaN in the OCP spec, never written by a
# quantizer): the float32 scale is inf there where the reference's ldexp stays finite
dec = CODEC.decode(raw, ROWS, COLS, torch.float32)
fin = (scales != 255).repeat_interleave(32, dim=1)
assert torch.equal(want_f32[fin], dec[fin])
assert torch.equal(want_f32[fin].signbit(), dec[fin].signbit())  # -0.0 for nibble 8
assert (~fin).sum() == 32 and want_f32[~fin].isinf().sum() == 28  # and 4 NaN (nibbles 0, 8)

def same(a, b):
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]) and torch.equal(
        a[~nan].signbit(), b[~nan].signbit()
    )

# BK 32 and 128 columns a chunk, tiles of 16 and 32 rows (16 past the matrix), WARPS 1 and 4:
# the tile's arrangement follows (row, block) pairs against 32 x WARPS threads (the interpreter
# runs no warps): word-major (the 1st, 3rd, 5th case) or row-major (the 2nd, 4th), both at BK 32
for dtype, bk, bn, warps in (
    (torch.bfloat16, 32, 32, 1),
    (torch.float16, 32, 16, 1),
    (torch.float32, 32, 32, 1),
    (torch.bfloat16, 128, 16, 4),
    (torch.float16, 128, 16, 1),
):
    w = want_f32.to(dtype).float()
    eye = torch.eye(COLS, dtype=dtype)
    out = torch.empty(COLS, bn)
    column[(COLS,)](raw, eye, out, ROWS, COLS, ROWS * COLS // 2, BN=bn, BK=bk, WARPS=warps)
    out = out[:, :ROWS]
    # the reference: the same sums of products over the chunk (past the row: +0), each
    # with one nonzero term at most, so exact in any order; a chunk holding the scale
    # 255 block (or, in fp16, any overflowed one) is NaN through inf x 0, as the kernel's
    pad = -COLS % bk
    wp = torch.nn.functional.pad(w, (0, pad))
    xp = torch.nn.functional.pad(eye.float(), (0, pad))
    ref = torch.empty(COLS, ROWS)
    for k0 in range(0, COLS, bk):
        ch = slice(k0, k0 + bk)
        ref[ch] = (xp[ch, None, ch] * wp[None, :, ch]).sum(-1)
    assert same(out, ref), (dtype, bk, (out != ref).nonzero()[:8].tolist())
    if bk == 32:  # one block a chunk: every weight but the scale 255 block's is read out
        keep = fin.T & ~ref.isnan()
        assert torch.equal(out[keep], w.T[keep]) and keep.sum() >= ROWS * COLS // 2
print("ok")
"""


def test_mxfp4_dot_chunk_decodes_every_nibble_and_scale_exactly() -> None:
    """`dot_chunk` on MXFP4 (the slot kernel's decode path) reads every weight exactly: a
    [16, 544] matrix whose blocks hold every byte value and each nibble in both halves, under
    every scale byte 0..255, dotted in the interpreter with each row of the identity (each
    program the chunk holding its column, 32 and 128 columns a chunk, the last one partly past
    the row, in both of the tile's arrangements) equals bit for bit (the sign of zero and NaN
    positions too) the E2M1 value times the float32 scale rounded to the model dtype (bf16,
    fp16, fp32), summed with the chunk's other products x 0. That value is the codec's decode
    (weights/mxfp4.py) but for scale 255 (inf, see the check). One-hot dots keep the
    comparison exact whatever order the kernel sums in, and a nibble or word read from the
    wrong place changes the read-out weights (a swap of the nibbles in each byte fails)."""
    pytest.importorskip("triton")
    _run_in_interpreter(_MXFP4_EXACT)
