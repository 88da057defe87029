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
    pytest.importorskip("triton")
    _run_in_interpreter(_MXFP4_KERNELS)
