"""MXFP4 codec: decode equals transformers' dequantization bit for bit on random blocks and
scales (every E8M0 exponent, the inf/NaN corners included), the packed-expert split decodes
each part, the quantizer stays within a grid step, and bad input says what is wrong."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from moetier.weights.formats import ExpertFormat, ExpertShape, get_codec
from moetier.weights.mxfp4 import FP4_VALUES, MXFP4, quantize


def _random(
    rows: int, groups: int, seed: int, lo: int = 0, hi: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(lo, hi, (rows, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


def _reference(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' [rows, cols] (it returns [E, cols, rows] for [E, rows, G, 16])."""
    return convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0].t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_transformers(dtype: torch.dtype) -> None:
    blocks, scales = _random(48, 3, seed=0)
    raw = MXFP4.encode(blocks, scales)
    assert raw.numel() == MXFP4.nbytes(48, 96) == 48 * 3 * 17
    got = MXFP4.decode(raw, 48, 96, dtype)
    want = _reference(blocks, scales, dtype)
    assert got.dtype == dtype and got.shape == (48, 96)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    # Realistic scales only: no inf or NaN, and the values are not all zero.
    blocks, scales = _random(64, 2, seed=1, lo=110, hi=135)
    got = MXFP4.decode(MXFP4.encode(blocks, scales), 64, 64, dtype)
    assert torch.isfinite(got).all() and got.abs().sum() > 0
    assert torch.equal(got, _reference(blocks, scales, dtype))


def test_nibble_order_and_scale() -> None:
    # One byte: low nibble is the even element, high nibble the odd one; scale 128 doubles.
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2 | (0xF << 4)  # +1.0 then -6.0
    scales = torch.tensor([[128]], dtype=torch.uint8)
    got = MXFP4.decode(MXFP4.encode(blocks, scales), 1, 32, torch.float32)
    assert got[0, :2].tolist() == [2.0, -12.0] and not got[0, 2:].any()
    assert FP4_VALUES[0x2] == 1.0 and FP4_VALUES[0xF] == -6.0


def test_registered_and_split_decodes_each_part() -> None:
    assert get_codec("mxfp4") is MXFP4
    shape = ExpertShape(hidden=64, intermediate=32)
    fmt = ExpertFormat(shape, torch.float32, (MXFP4, MXFP4, MXFP4))
    mats = [_random(32, 2, seed=2), _random(32, 2, seed=3), _random(64, 1, seed=4)]
    mats = [(b, (s % 20 + 115).to(torch.uint8)) for b, s in mats]
    flat = torch.zeros(fmt.nbytes + 16, dtype=torch.uint8)  # a slot may be longer
    for part, (b, s) in zip(fmt.parts(flat), mats):
        part.copy_(MXFP4.encode(b, s))
    gate_up, down = fmt.split(flat)
    want = [_reference(b, s, torch.float32) for b, s in mats]
    assert torch.equal(gate_up, torch.cat(want[:2])) and torch.equal(down, want[2])
    assert fmt.name == "mxfp4" and fmt.nbytes == 3 * 32 * 64 * 17 // 32


def test_quantize_within_a_grid_step() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 64, generator=g)
    blocks, scales = quantize(w)
    assert blocks.shape == (16, 2, 16) and scales.shape == (16, 2)
    back = MXFP4.decode(MXFP4.encode(blocks, scales), 16, 64, torch.float32)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)  # the grid's unit
    assert ((back - w).abs() <= step + 1e-6).all()  # E2M1 steps are at most 2 units
    assert (back - w).abs().mean() < 0.15 * w.abs().mean()  # FP4 is coarse: ~12%
    # Representable values come back exactly.
    exact = torch.tensor(FP4_VALUES).repeat(2)[None, :].expand(4, 32) * 0.25
    eb, es = quantize(exact)
    assert torch.equal(MXFP4.decode(MXFP4.encode(eb, es), 4, 32, torch.float32), exact)


def test_bad_input_is_explained() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        MXFP4.nbytes(4, 48)
    blocks, scales = _random(4, 2, seed=6)
    with pytest.raises(ValueError, match=r"need uint8 \[4, 2, 16\]"):
        MXFP4.encode(blocks[:, :1], scales)
    with pytest.raises(ValueError, match="E8M0 scales are uint8"):
        MXFP4.encode(blocks, scales.to(torch.int32))
