"""GGUF block types as matrix codecs: Q8_0, Q6_K, Q5_K, Q4_K (and F32/F16/BF16), decoded in torch;
MXFP4 experts transcoded into weights/mxfp4.py's codec.

A GGUF matrix [rows, cols] is stored row-major as rows of blocks along cols (the reduction dim):
each block holds `block_size` values in `type_size` bytes (fp16 scales, packed quants). The
encoded bytes of a codec are exactly those blocks as the file stores them, so an expert is read
by offset and moved between tiers as stored; `decode` turns them into [rows, cols] on whatever
device holds them (CPU or CUDA: plain tensor ops, vectorized over blocks). Decoding follows
`gguf.quants.dequantize` operation for operation, so float32 results are equal to it.

MXFP4 (ggml's `block_mxfp4`, gpt-oss files) is the one type kept in another layout: the same
values as the gpt-oss safetensors experts, so each expert's blocks are rearranged once as they
are read (`GGUF_TRANSCODED`, same byte count) into `Mxfp4Codec`'s layout, which every tier and
kernel already computes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetier.weights.formats import MatrixCodec, register_codec
from moetier.weights.mxfp4 import MXFP4

QK_K = 256  # values per K-quant super-block

# GGML type ids (gguf.GGMLQuantizationType) of the types decoded here.
F32, F16, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 8, 12, 13, 14, 30
GGML_MXFP4 = 39

_Decoder = Callable[[torch.Tensor], torch.Tensor]  # [n, type_size] uint8 -> [n, block] float32


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 (little-endian fp16) -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _shifts(device: torch.device, end: int, step: int) -> torch.Tensor:
    """Bit shifts 0, step, .. < end as uint8, made on `device` (no host copy: CUDA-graph safe)."""
    return torch.arange(0, end, step, dtype=torch.uint8, device=device)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    x = blocks[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block from its 12 packed bytes."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, 8, 1)
    offset = (dmin * mn.float()).reshape(n, 8, 1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> _shifts(blocks.device, 8, 4).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32).float()
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, 8, 1)
    offset = (dmin * mn.float()).reshape(n, 8, 1)
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    ql = qs.reshape(n, 4, 1, 32) >> _shifts(blocks.device, 8, 4).reshape(1, 1, 2, 1)
    hi = qh.reshape(n, 1, 1, 32) >> _shifts(blocks.device, 8, 1).reshape(1, 1, 8, 1)
    q = ((ql & 0x0F).reshape(n, 8, 32) | ((hi & 0x01).reshape(n, 8, 32) << 4)).float()
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks[:, 208:210])
    scale = (d * scales).reshape(n, QK_K // 16, 1)
    lo = ql.reshape(n, 2, 1, 64) >> _shifts(blocks.device, 8, 4).reshape(1, 1, 2, 1)
    hi = qh.reshape(n, 2, 1, 32) >> _shifts(blocks.device, 8, 2).reshape(1, 1, 4, 1)
    q = (lo & 0x0F).reshape(n, 8, 32) | ((hi & 0x03).reshape(n, 8, 32) << 4)
    q = (q.view(torch.int8) - 32).reshape(n, QK_K // 16, 16).float()
    return (scale * q).reshape(n, QK_K)


@dataclass(frozen=True)
class GGUFCodec:
    """One GGUF block type as a `MatrixCodec` (formats.py): blocks of `block_size` values in
    `type_size` bytes along each row."""

    name: str
    ggml_type: int
    block_size: int
    type_size: int
    decoder: _Decoder | None = None  # None: a plain float type (`float_dtype`)
    float_dtype: torch.dtype | None = None

    def check(self, cols: int) -> None:
        if cols % self.block_size:
            raise ValueError(
                f"{self.name} stores rows in blocks of {self.block_size} values; a row of "
                f"{cols} is not a whole number of blocks"
            )

    def nbytes(self, rows: int, cols: int) -> int:
        self.check(cols)
        return rows * (cols // self.block_size) * self.type_size

    def decode(self, raw: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        n = self.nbytes(rows, cols)
        if raw.numel() < n:
            raise ValueError(
                f"{self.name}: {raw.numel()} bytes for a [{rows}, {cols}] matrix that needs {n}"
            )
        raw = raw[:n]
        if self.decoder is None:
            assert self.float_dtype is not None
            if raw.storage_offset() % self.type_size:
                raw = raw.clone()
            return raw.view(self.float_dtype).view(rows, cols).to(dtype)
        blocks = raw.reshape(-1, self.type_size)
        return self.decoder(blocks).reshape(rows, cols).to(dtype)


GGUF_CODECS: dict[int, MatrixCodec] = {
    c.ggml_type: register_codec(c)
    for c in (
        GGUFCodec("gguf-f32", F32, 1, 4, float_dtype=torch.float32),
        GGUFCodec("gguf-f16", F16, 1, 2, float_dtype=torch.float16),
        GGUFCodec("gguf-bf16", BF16, 1, 2, float_dtype=torch.bfloat16),
        GGUFCodec("gguf-q8_0", Q8_0, 32, 34, _q8_0),
        GGUFCodec("gguf-q4_k", Q4_K, QK_K, 144, _q4_k),
        GGUFCodec("gguf-q5_k", Q5_K, QK_K, 176, _q5_k),
        GGUFCodec("gguf-q6_k", Q6_K, QK_K, 210, _q6_k),
    )
}


def mxfp4_from_ggml(raw: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """ggml `block_mxfp4` bytes of a [rows, cols] matrix -> `Mxfp4Codec`'s encoding of the
    same values (a new uint8 tensor of the same byte count, on raw's device).

    ggml: per 32 values one block of 17 bytes, the E8M0 scale byte `e`, then `qs[16]` where
    byte j holds element j in its low nibble and element j + 16 in its high nibble (the
    E2M1 nibbles and the scale mean what they mean in weights/mxfp4.py: ggml's doubled value
    table times 2^(e - 128) is the E2M1 value times 2^(e - 127)). Mxfp4Codec: every block's
    16 bytes with element 2k in byte k's low nibble and 2k + 1 in its high one, then every
    block's scale byte."""
    g = cols // 32
    if cols % 32 or raw.numel() != rows * g * 17:
        raise ValueError(f"MXFP4: {raw.numel()} bytes are no [{rows}, {cols}] matrix of blocks")
    blocks = raw.reshape(rows, g, 17)
    qs = blocks[..., 1:]
    nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, g, 16, 2)  # by element
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return MXFP4.encode(packed, blocks[..., 0])


@dataclass(frozen=True)
class Transcoded:
    """A GGUF type whose experts are kept in another codec's layout: `convert(raw, rows,
    cols)` turns a matrix's stored bytes into `codec`'s encoding (the same number of bytes)."""

    codec: MatrixCodec
    convert: Callable[[torch.Tensor, int, int], torch.Tensor]


GGUF_TRANSCODED: dict[int, Transcoded] = {GGML_MXFP4: Transcoded(MXFP4, mxfp4_from_ggml)}


def ggml_type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type {ggml_type}"


def codec_for(ggml_type: int, tensor: str, file: object = "") -> MatrixCodec:
    """The codec of a GGUF tensor's type (a transcoded type's: `GGUF_TRANSCODED`); a clear
    error for a type moetier does not decode."""
    codec = GGUF_CODECS.get(int(ggml_type))
    if codec is None and int(ggml_type) in GGUF_TRANSCODED:
        codec = GGUF_TRANSCODED[int(ggml_type)].codec
    if codec is None:
        known = ", ".join(ggml_type_name(t) for t in [*GGUF_CODECS, *GGUF_TRANSCODED])
        where = f"{file}: " if file else ""
        raise ValueError(
            f"{where}tensor {tensor} is stored as {ggml_type_name(ggml_type)}, which moetier "
            f"does not read for experts (supported: {known}); use a file quantized with "
            f"Q4_K_M, Q5_K_M, Q6_K or Q8_0 (gpt-oss: MXFP4)"
        )
    return codec


def random_blocks(
    codec: GGUFCodec, rows: int, cols: int, scale: float, generator: torch.Generator
) -> torch.Tensor:
    """Random valid blocks of a [rows, cols] matrix ([rows, bytes per row] uint8): finite fp16
    scales and random quants, values about +-`scale` and centred on zero. For synthetic and
    test files (the gguf package quantizes no K type); no float matrix is quantized."""
    n = codec.nbytes(rows, cols) // codec.type_size
    g = generator

    def u8(count: int) -> torch.Tensor:
        return torch.randint(0, 256, (n, count), dtype=torch.uint8, generator=g)

    def f16(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.float16).view(torch.uint8).reshape(n, -1)

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, 1, generator=g)

    if codec.decoder is None:
        assert codec.float_dtype is not None
        values = torch.randn(rows, cols, generator=g) * scale
        return values.to(codec.float_dtype).view(torch.uint8).reshape(rows, -1)
    if codec.ggml_type == Q8_0:
        blocks = torch.cat([f16(uniform(0.5, 1.0) * scale / 127), u8(32)], dim=1)
    elif codec.ggml_type in (Q4_K, Q5_K):
        top = 15 if codec.ggml_type == Q4_K else 31
        d = uniform(0.5, 1.0) * scale / (31 * top)
        dmin = d * (top / 2) * uniform(0.9, 1.1)
        # six-bit scales and mins: the packed bytes with each 6-bit value in 16..47
        parts = [f16(d), f16(dmin), u8(12) & 0x1F | 0x10]
        body = 32 + 128 if codec.ggml_type == Q5_K else 128
        blocks = torch.cat(parts + [u8(body)], dim=1)
    elif codec.ggml_type == Q6_K:
        d = uniform(0.5, 1.0) * scale / (64 * 32)
        blocks = torch.cat([u8(192), u8(16) & 0x3F | 0x20, f16(d)], dim=1)
    else:
        raise ValueError(f"no random blocks for {codec.name}")
    return blocks.reshape(rows, -1)
