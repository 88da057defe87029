"""FP8 slots read in place by the expert kernels: the slot kernel and the grouped kernel (Triton's
interpreter on the CPU) equal the reference on the slots' exact dequantization, partial scale
blocks included; the slot layout says where each matrix and its scales lie."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.slot_layout import FP8, dense_layout, layer_layout, slot_layout
from moetier.weights.formats import ExpertFormat, ExpertPacking, ExpertShape, Fp8BlockCodec
from tests.models.fp8 import quantize_blocks
from tests.unit.test_expert_ffn import _run_in_interpreter


def test_fp8_slot_layout_offsets() -> None:
    codec = Fp8BlockCodec((16, 16))
    fmt = ExpertFormat(ExpertShape(72, 40), torch.bfloat16, (codec,) * 3)
    layouts = slot_layout(ExpertPacking({1: fmt, 2: fmt}))
    assert layouts is not None and layouts[1] == layouts[2]
    layout = layouts[1]
    assert layout.gate_up_format == layout.down_format == FP8 and layout.block == (16, 16)
    part = 40 * 72 + 4 * 3 * 5  # values, then 3 x 5 float32 scales (aligned: 2880 + 60 -> 2944)
    assert fmt.part_bytes == (2944, 2944, 2944) and part == 2940
    assert (layout.up, layout.down, layout.scales) == (2944, 2 * 2944, 2880)
    assert dense_layout(72, 40) == layer_layout(ExpertFormat(ExpertShape(72, 40), torch.bfloat16))


class _Unread:
    """A format no kernel reads."""

    name = "int3"

    def nbytes(self, rows: int, cols: int) -> int:
        return rows * cols

    def decode(self, raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


def test_layouts_per_layer_and_none_for_an_unread_format() -> None:
    shape = ExpertShape(72, 40)
    a = ExpertFormat(shape, torch.bfloat16, (Fp8BlockCodec((16, 16)),) * 3)
    b = ExpertFormat(shape, torch.bfloat16, (Fp8BlockCodec((32, 32)),) * 3)
    layouts = slot_layout(ExpertPacking({1: a, 2: b}))
    assert layouts is not None and (layouts[1].block, layouts[2].block) == ((16, 16), (32, 32))
    c = ExpertFormat(shape, torch.bfloat16, (_Unread(),) * 3)
    assert slot_layout(ExpertPacking({1: a, 2: c})) is None


_FP8_KERNELS = """
import torch
from moetier.kernels.expert_ffn import expert_ffn, expert_ffn_reference
from moetier.kernels.grouped_ffn import grouped_ffn, grouped_ffn_reference
from moetier.kernels.slot_layout import slot_layout
from moetier.weights.formats import ExpertFormat, ExpertPacking, ExpertShape, Fp8BlockCodec
from tests.models.fp8 import quantize_blocks

g = torch.Generator().manual_seed(0)
d, i, s, e = 72, 40, 6, 6
codec = Fp8BlockCodec((16, 16))
for dtype in (torch.float32, torch.bfloat16):
    fmt = ExpertFormat(ExpertShape(d, i), dtype, (codec,) * 3)
    packing = ExpertPacking({0: fmt})
    layout = slot_layout(packing)[0]
    pool = torch.zeros(s, packing.numel, dtype=torch.uint8)
    dense = torch.empty(s, 3 * i * d, dtype=dtype)
    for slot in range(s):
        mats = [torch.randn(i, d, generator=g), torch.randn(i, d, generator=g),
                torch.randn(d, i, generator=g)]
        for part, w in zip(fmt.parts(pool[slot]), mats):
            part.copy_(codec.encode(*quantize_blocks(w / d**0.5, (16, 16))))
        gate_up, down = fmt.split(pool[slot])
        dense[slot] = torch.cat([gate_up.flatten(), down.flatten()])
    # fp32: against the reference; bf16: against the dense kernel on the decoded pool (the same
    # dequantized weights; the interpreter's bf16 casts may land one ulp off)
    fp32 = dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-5) if fp32 else dict(rtol=2**-6, atol=2**-6)
    # slot kernel, decode-sized
    x = torch.randn(2, d, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(s, generator=g)[:3] for _ in range(2)]).sort(-1).values
    w = torch.rand(2, 3, generator=g)
    want = expert_ffn_reference(x, dense, slots, w, i)
    assert torch.equal(expert_ffn_reference(x, pool, slots, w, i, layout), want)
    ref = want if fp32 else expert_ffn(x, dense, slots, w, i)
    torch.testing.assert_close(expert_ffn(x, pool, slots, w, i, layout), ref, **tol)
    # grouped kernel, prefill-sized, with a skipped pair (another wave's expert)
    x = torch.randn(9, d, generator=g).to(dtype)
    experts = torch.stack([torch.randperm(e, generator=g)[:3] for _ in range(9)]).sort(-1).values
    slots = experts.clone().to(torch.int32)
    slots[0, 1] = -1
    w = torch.rand(9, 3, generator=g)
    want = grouped_ffn_reference(x, dense, slots, w, i)
    torch.testing.assert_close(grouped_ffn_reference(x, pool, slots, w, i, None, layout), want,
                               rtol=0, atol=0)
    got = grouped_ffn(x, pool, slots, w, i, e, experts=experts, layout=layout)
    ref = want if fp32 else grouped_ffn(x, dense, slots, w, i, e, experts=experts)
    torch.testing.assert_close(got, ref, **tol)
print("ok")
"""


def test_fp8_kernels_match_reference_in_interpreter() -> None:
    pytest.importorskip("triton")
    _run_in_interpreter(_FP8_KERNELS)


def test_encoded_part_is_what_the_codec_decodes() -> None:
    codec = Fp8BlockCodec((16, 16))
    w = torch.randn(40, 72)
    raw = codec.encode(*quantize_blocks(w, (16, 16)))
    values = raw[: 40 * 72].view(torch.float8_e4m3fn).view(40, 72).float()
    scales = raw[2880 : 2880 + 60].view(torch.float32).view(3, 5)
    block = scales[2, 4]  # rows 32..39, cols 64..71: the partial corner block
    assert torch.equal(codec.decode(raw, 40, 72, torch.float32)[32:, 64:], values[32:, 64:] * block)
