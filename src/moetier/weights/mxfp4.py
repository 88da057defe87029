"""MXFP4 (OCP microscaling FP4, as gpt-oss checkpoints store their experts): a codec that keeps
experts as stored and decodes them where they are computed.

A matrix [rows, cols] is stored as `blocks` [rows, cols/32, 16] uint8 and `scales`
[rows, cols/32] uint8: each group of 32 consecutive values along a row shares one E8M0 scale
(2^(scale - 127)) and each byte holds two FP4 (E2M1) values, the even element in its low
nibble and the odd one in its high nibble. The value table and nibble order are those of
transformers' integrations/mxfp4.py (`convert_moe_packed_tensors`), the reference this decode
equals. Encoded (one matrix): the block bytes row-major, then the scale bytes row-major.
"""

from __future__ import annotations

import math

import torch

from moetier.weights.formats import register_codec

GROUP = 32  # values per scale
# E2M1 values by nibble: sign bit 3, then exponent and mantissa.
FP4_VALUES = (
    *(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    *(-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
)
_LUTS: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    lut = _LUTS.get(device)
    if lut is None:
        lut = _LUTS[device] = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return lut


class Mxfp4Codec:
    """One [rows, cols] matrix as MXFP4 blocks and E8M0 scales (cols a multiple of 32)."""

    name = "mxfp4"

    @staticmethod
    def _groups(cols: int) -> int:
        if cols % GROUP:
            raise ValueError(f"MXFP4 needs the reduction dim to be a multiple of 32, not {cols}")
        return cols // GROUP

    def nbytes(self, rows: int, cols: int) -> int:
        g = self._groups(cols)
        return rows * g * 16 + rows * g

    def encode(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The stored tensors of one matrix (blocks [rows, G, 16], scales [rows, G], uint8)
        -> its encoded bytes (a new CPU uint8 tensor)."""
        rows, g = scales.shape
        if tuple(blocks.shape) != (rows, g, 16) or blocks.dtype != torch.uint8:
            raise ValueError(
                f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match scales "
                f"{tuple(scales.shape)}: need uint8 [{rows}, {g}, 16]"
            )
        if scales.dtype != torch.uint8:
            raise ValueError(f"MXFP4 scales are stored as {scales.dtype}; E8M0 scales are uint8")
        return torch.cat([blocks.contiguous().flatten(), scales.contiguous().flatten()])

    def decode(self, raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        g = self._groups(cols)
        n = rows * g * 16
        blocks = raw[:n].view(rows, g, 16)
        exps = raw[n : n + rows * g].view(rows, g).to(torch.int32) - 127
        nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).view(rows, g, GROUP)
        values = _lut(raw.device)[nibbles.long()]  # [rows, G, 32] float32
        # values x 2^exp, as the reference's ldexp (exact in float32 up to its range)
        return torch.ldexp(values, exps[..., None]).view(rows, cols).to(dtype)


MXFP4 = Mxfp4Codec()
register_codec(MXFP4)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix [rows, cols] -> (blocks [rows, cols/32, 16], scales [rows, cols/32])
    uint8: each group's scale is the smallest power of two that brings its largest magnitude
    within 6 (E2M1's largest), each value the nearest E2M1 value (ties to the lower nibble).
    For tests and synthetic checkpoints: moetier itself only decodes."""
    rows, cols = w.shape
    g = Mxfp4Codec._groups(cols)
    x = w.float().reshape(rows, g, GROUP)
    amax = x.abs().amax(dim=-1).clamp(min=2.0**-126)  # [rows, G]
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)[..., None]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    nibbles = (scaled[..., None] - lut).abs().argmin(dim=-1).to(torch.uint8)  # [rows, G, 32]
    pairs = nibbles.view(rows, g, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def random_encoded(rows: int, cols: int, rms: float, generator: torch.Generator) -> torch.Tensor:
    """The encoded bytes of a random valid [rows, cols] matrix: random nibbles (any byte is two
    valid E2M1 values) and per-block scales spread over four exponents around the one that puts
    the values' RMS near `rms` (random nibbles have an RMS of 2.93 units). For tests and
    benchmarks of the kernels' decode: no float matrix is quantized."""
    g = Mxfp4Codec._groups(cols)
    blocks = torch.randint(0, 256, (rows, g, 16), dtype=torch.uint8, generator=generator)
    base = 127 + round(math.log2(rms / 2.93))
    exps = base + torch.randint(-2, 2, (rows, g), generator=generator)
    return MXFP4.encode(blocks, exps.clamp(0, 254).to(torch.uint8))
