"""How a routed expert is stored: dense in the compute dtype, or compressed and decoded on use.

A packed expert moves between tiers as one flat buffer (one copy). Dense: gate_up [2I, D] (gate
rows, then up rows) followed by down [D, I], in the compute dtype. Compressed: its three matrices
gate [I, D], up [I, D] and down [D, I], each encoded by a `MatrixCodec` (block-quantized values
and their scales, as the checkpoint stores them) and laid back to back as bytes, each part
starting on a 16-byte boundary. Budgets, slots, host rows and copies count these bytes; the
expert is decoded only where it is computed (`ExpertFormat.split`).

Codecs register by name (`register_codec`); the GGUF and MXFP4 codecs live with their readers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

_DENSE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ALIGN = 16  # bytes: every encoded part and every packed expert starts on this boundary


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ExpertShape:
    """Geometry of one routed expert: D hidden, I intermediate."""

    hidden: int
    intermediate: int

    @property
    def numel(self) -> int:
        return 3 * self.hidden * self.intermediate

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (gate_up [2I, D], down [D, I]) of a dense packed expert buffer."""
        d, i = self.hidden, self.intermediate
        return flat[: 2 * i * d].view(2 * i, d), flat[2 * i * d :].view(d, i)


class MatrixCodec(Protocol):
    """One encoding of a [rows, cols] weight matrix as bytes (cols is the reduction dim)."""

    @property
    def name(self) -> str:
        """The format's name in stats, metrics and errors."""
        ...

    def nbytes(self, rows: int, cols: int) -> int:
        """Encoded size of a [rows, cols] matrix."""
        ...

    def decode(self, raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """raw: 1-D uint8 of exactly nbytes(rows, cols), on any device -> [rows, cols] in
        `dtype` on raw's device, equal to the reference dequantization rounded to `dtype`."""
        ...


_CODECS: dict[str, MatrixCodec] = {}


def register_codec(codec: MatrixCodec) -> MatrixCodec:
    _CODECS[codec.name] = codec
    return codec


def get_codec(name: str) -> MatrixCodec:
    try:
        return _CODECS[name]
    except KeyError:
        known = ", ".join(sorted(_CODECS))
        raise ValueError(f"unknown expert weight format {name!r} (known: {known})") from None


@dataclass(frozen=True)
class Fp8BlockCodec:
    """FP8 e4m3 values with one float32 scale per 128x128 block (DeepSeek-V3, Qwen3-*-FP8:
    `weight` F8_E4M3 and `weight_scale_inv` [ceil(rows/128), ceil(cols/128)]); the value is
    fp8 x its block's scale. Encoded: the values row-major, then (from `scale_offset`) the
    scales row-major."""

    block: tuple[int, int] = (128, 128)

    @property
    def name(self) -> str:
        b = self.block
        return "fp8_e4m3" if b == (128, 128) else f"fp8_e4m3_b{b[0]}x{b[1]}"

    @staticmethod
    def scale_offset(rows: int, cols: int) -> int:
        return _aligned(rows * cols)

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        br, bc = self.block
        return -(-rows // br), -(-cols // bc)

    def nbytes(self, rows: int, cols: int) -> int:
        sr, sc = self.scale_shape(rows, cols)
        return self.scale_offset(rows, cols) + 4 * sr * sc

    def encode(self, values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """The stored tensors of one matrix -> its encoded bytes (a new CPU uint8 tensor)."""
        rows, cols = values.shape
        out = torch.zeros(self.nbytes(rows, cols), dtype=torch.uint8)
        out[: rows * cols] = values.contiguous().view(torch.uint8).flatten()
        sr, sc = self.scale_shape(rows, cols)
        if tuple(scale_inv.shape) != (sr, sc):
            raise ValueError(
                f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a [{rows}, {cols}] weight "
                f"in {self.block[0]}x{self.block[1]} blocks needs ({sr}, {sc})"
            )
        scales = scale_inv.to(torch.float32).contiguous().view(torch.uint8).flatten()
        out[self.scale_offset(rows, cols) :] = scales
        return out

    def decode(self, raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        sr, sc = self.scale_shape(rows, cols)
        values = raw[: rows * cols].view(torch.float8_e4m3fn).view(rows, cols)
        start = self.scale_offset(rows, cols)
        scales = raw[start : start + 4 * sr * sc].view(torch.float32).view(sr, sc)
        return dequantize_blocks(values, scales, self.block).to(dtype)


def dequantize_blocks(
    values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """values [rows, cols] x the scale of each one's block ([ceil(rows/br), ceil(cols/bc)]),
    in float32. The last block of a dimension may be partial (DeepSeek's 576-row
    kv_a_proj_with_mqa ends with a 64-row block)."""
    rows, cols = values.shape
    br, bc = block
    full = scales.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    return values.float() * full


FP8_BLOCK = register_codec(Fp8BlockCodec())


@dataclass(frozen=True)
class ExpertFormat:
    """How one MoE layer's experts are packed. `codecs` (gate, up, down) None = dense in
    `dtype`; else each matrix is stored encoded and the packed expert is uint8 bytes."""

    shape: ExpertShape
    dtype: torch.dtype
    codecs: tuple[MatrixCodec, MatrixCodec, MatrixCodec] | None = None

    @property
    def compressed(self) -> bool:
        return self.codecs is not None

    @property
    def name(self) -> str:
        if self.codecs is None:
            return _DENSE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch."))
        names = [c.name for c in self.codecs]
        return names[0] if len(set(names)) == 1 else "/".join(names)

    def _dims(self) -> tuple[tuple[int, int], ...]:
        d, i = self.shape.hidden, self.shape.intermediate
        return (i, d), (i, d), (d, i)

    @property
    def part_bytes(self) -> tuple[int, int, int]:
        """Aligned bytes of gate, up and down (compressed formats)."""
        assert self.codecs is not None
        g, u, dn = (_aligned(c.nbytes(*rc)) for c, rc in zip(self.codecs, self._dims()))
        return g, u, dn

    @property
    def nbytes(self) -> int:
        """Bytes of one packed expert."""
        if self.codecs is None:
            return self.shape.numel * torch.empty((), dtype=self.dtype).element_size()
        return sum(self.part_bytes)

    def parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The encoded gate, up and down of a packed expert (views of `flat`, uint8)."""
        out, start = [], 0
        for n, c, rc in zip(self.part_bytes, self.codecs or (), self._dims()):
            out.append(flat[start : start + c.nbytes(*rc)])
            start += n
        return out

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, D], down [D, I]) in `dtype` of a packed expert: views when dense,
        decoded copies when compressed (`flat` may be longer than the expert: a slot)."""
        if self.codecs is None:
            return self.shape.split(flat)
        gate, up, down = (
            c.decode(raw, *rc, self.dtype)
            for c, raw, rc in zip(self.codecs, self.parts(flat), self._dims())
        )
        return torch.cat([gate, up]), down


@dataclass(frozen=True)
class ExpertPacking:
    """The packing of every MoE layer's experts: what host rows and device slots hold. Rows
    are `numel` elements of `storage_dtype`: the largest layer's packed expert (a GGUF Q4_K_M
    file stores some layers' down in Q6_K), so any slot holds any layer's expert."""

    formats: dict[int, ExpertFormat]

    @property
    def shape(self) -> ExpertShape:
        return next(iter(self.formats.values())).shape

    @property
    def compressed(self) -> bool:
        return any(f.compressed for f in self.formats.values())

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.compressed:
            return torch.uint8
        return next(iter(self.formats.values())).dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one slot (or host row)."""
        most = max(f.nbytes for f in self.formats.values())
        return _aligned(most) if self.compressed else most

    @property
    def numel(self) -> int:
        return self.nbytes // torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def name(self) -> str:
        names = sorted({f.name for f in self.formats.values()})
        return names[0] if len(names) == 1 else "+".join(names)

    def splitter(self, layer: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        return self.formats[layer].split


def fp8_block(config: Any) -> tuple[int, int]:
    """The FP8 scale block of an HF config (`quantization_config.weight_block_size` of
    `quant_method: fp8`); 128x128 when the config names none."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return (128, 128)
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8" or not q.get("weight_block_size"):
        return (128, 128)
    rows, cols = q["weight_block_size"]
    return int(rows), int(cols)
