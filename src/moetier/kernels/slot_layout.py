"""Where a packed expert's three matrices lie in a slot row, and how they are stored: what the
expert kernels (expert_ffn.py, grouped_ffn.py) need to read a slot in place.

Dense (the compute dtype): gate [I, D] at 0, up [I, D] at I*D, down [D, I] at 2*I*D elements.
FP8 e4m3 with block scales (weights/formats.py `Fp8BlockCodec`): the pool is bytes; each matrix
is its values row-major followed, `scales` bytes after its start, by one float32 per block of
`block` = (rows, cols). Every other compressed format has no kernel: `slot_layout` returns None
and its experts take the per-expert loop, decoded one at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetier.weights.formats import ExpertPacking, Fp8BlockCodec


@dataclass(frozen=True)
class SlotLayout:
    """Offsets in pool elements of up and down from a slot row's start (gate is at 0). FP8:
    `scales` is each matrix's scale offset from its own start, `block` its scale block, and
    `split` decodes one row to dense (gate_up [2I, D], down [D, I]) for the references."""

    up: int
    down: int
    fp8: bool = False
    scales: int = 0
    block: tuple[int, int] = (128, 128)
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


def dense_layout(hidden: int, inter: int) -> SlotLayout:
    return SlotLayout(up=inter * hidden, down=2 * inter * hidden)


def slot_layout(packing: ExpertPacking) -> SlotLayout | None:
    """The kernels' view of `packing`'s slots, or None when no kernel reads them (a compressed
    format other than FP8, or layers stored in different formats)."""
    shape = packing.shape
    if not packing.compressed:
        return dense_layout(shape.hidden, shape.intermediate)
    formats = list(packing.formats.values())
    first = formats[0]
    if any(f != first for f in formats) or first.codecs is None:
        return None
    codec = first.codecs[0]
    if not isinstance(codec, Fp8BlockCodec) or any(c != codec for c in first.codecs):
        return None
    gate, up, _ = first.part_bytes
    scales = codec.scale_offset(shape.intermediate, shape.hidden)  # the same for down [D, I]
    return SlotLayout(gate, gate + up, True, scales, codec.block, first.split)
