"""Where a packed expert's three matrices lie in a slot row, and how they are stored: what the
expert kernels (expert_ffn.py, grouped_ffn.py) need to read a slot in place.

Dense (the compute dtype): gate [I, D] at 0, up [I, D] at I*D, down [D, I] at 2*I*D elements.
Compressed (the pool is bytes; weights/formats.py): gate at 0, up and down at their parts'
offsets, each matrix in one of the block formats the tile loader decodes in registers
(kernels/_slot_tiles_triton.py `weight_tile`, by format code):
- FP8 e4m3 with float32 block scales (`Fp8BlockCodec`): the values row-major, then from
  `scales` bytes after the matrix's start one scale per `block` (rows, cols);
- GGUF Q8_0, Q4_K, Q5_K, Q6_K (weights/gguf_quants.py): each row the file's blocks as stored;
- MXFP4 (weights/mxfp4.py): the 16-byte blocks row-major (two E2M1 values a byte, the even
  column in the low nibble), then from `scales` = rows x cols / 2 bytes after the matrix's
  start one E8M0 byte per (row, 32 columns). gpt-oss interleaves gate and up rows in its
  fused tensor; packing de-interleaves them (weights/experts.py) as it does bf16 ones, so gate
  and up are two plain [I, D] matrices here whatever the source.
Gate and up share a format; down may differ (a Q4_K_M file stores some layers' down in Q6_K),
so the layout is per MoE layer. Any other format has no kernel: `slot_layout` returns None and
that layer's experts take the per-expert loop, decoded one at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetier.weights.formats import ExpertFormat, ExpertPacking, Fp8BlockCodec, MatrixCodec

# Format codes of weight_tile (constexpr in the kernels).
DENSE, FP8, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 = 0, 1, 2, 3, 4, 5, 6
_NAMED = {
    "gguf-q8_0": Q8_0,
    "gguf-q4_k": Q4_K,
    "gguf-q5_k": Q5_K,
    "gguf-q6_k": Q6_K,
    "mxfp4": MXFP4,
}


@dataclass(frozen=True)
class SlotLayout:
    """Offsets in pool elements of up and down from a slot row's start (gate is at 0), the
    format codes of gate/up and of down, and for FP8 and MXFP4 the scales' byte offset within
    a matrix (the same for gate/up [I, D] and down [D, I]), for FP8 its block. `split`
    decodes one row to dense (gate_up [2I, D], down [D, I]) for the references (compressed
    formats only)."""

    up: int
    down: int
    gate_up_format: int = DENSE
    down_format: int = DENSE
    scales: int = 0
    block: tuple[int, int] = (128, 128)
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def compressed(self) -> bool:
        return self.gate_up_format != DENSE


def dense_layout(hidden: int, inter: int) -> SlotLayout:
    return SlotLayout(up=inter * hidden, down=2 * inter * hidden)


def _code(codec: MatrixCodec) -> int | None:
    if isinstance(codec, Fp8BlockCodec):
        return FP8
    return _NAMED.get(codec.name)


def layer_layout(fmt: ExpertFormat) -> SlotLayout | None:
    """The kernels' view of one layer's slots, or None when no kernel reads its format."""
    shape = fmt.shape
    if fmt.codecs is None:
        return dense_layout(shape.hidden, shape.intermediate)
    gate, up, down = fmt.codecs
    codes = [_code(c) for c in fmt.codecs]
    if None in codes or gate != up:
        return None
    fp8 = [c for c in fmt.codecs if isinstance(c, Fp8BlockCodec)]
    if fp8 and (len(fp8) != 3 or len(set(fp8)) != 1):
        return None  # FP8 mixed with another format, or two FP8 block sizes
    g, u, _ = fmt.part_bytes
    scales, block = 0, (128, 128)
    if fp8:
        scales = fp8[0].scale_offset(shape.intermediate, shape.hidden)  # the same for [D, I]
        block = fp8[0].block
    gu_code, down_code = codes[0], codes[2]
    if MXFP4 in codes:
        if len(set(codes)) != 1:
            return None  # MXFP4 beside another format: one scale offset serves all three
        scales = shape.intermediate * shape.hidden // 2  # after the blocks: 16 bytes per 32 values
    assert gu_code is not None and down_code is not None
    return SlotLayout(g, g + u, gu_code, down_code, scales, block, fmt.split)


def slot_layout(packing: ExpertPacking) -> dict[int, SlotLayout] | None:
    """Each MoE layer's kernel layout, or None when some layer's format has no kernel."""
    layouts = {layer: layer_layout(f) for layer, f in packing.formats.items()}
    if any(v is None for v in layouts.values()):
        return None
    return {k: v for k, v in layouts.items() if v is not None}


def chunk_cols(bk: int, fmt: int, layout: SlotLayout) -> int:
    """The reduction chunk the tile loaders (`dot_chunk`, `weight_tile_kn`) take for a
    format: a GGUF K-quant super-block (256), a multiple of Q8_0's or MXFP4's 32-column
    blocks, an FP8 chunk inside one scale block (a power-of-two block); else `bk`."""
    if fmt in (Q4_K, Q5_K, Q6_K):
        return 256
    if fmt in (Q8_0, MXFP4):
        return max(32, bk)
    if fmt == FP8 and layout.block[1] & (layout.block[1] - 1) == 0:
        return min(bk, layout.block[1])
    return bk
