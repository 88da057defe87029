"""GGUF block decoders equal `gguf.quants.dequantize` exactly (float32) on random valid blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moetier.weights.formats import ExpertFormat, ExpertShape, get_codec
from moetier.weights.gguf_quants import (
    GGUF_CODECS,
    GGUFCodec,
    codec_for,
    mxfp4_from_ggml,
    random_blocks,
)
from moetier.weights.mxfp4 import MXFP4

TYPES = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32]


def _fp16_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite fp16 values (as bytes [n, 2]) spanning signs and magnitudes."""
    values = rng.uniform(-2.0, 2.0, n) * 10.0 ** rng.integers(-4, 1, n)
    return np.frombuffer(values.astype(np.float16).tobytes(), np.uint8).reshape(n, 2)


def _any_valid_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Fully random quants and scale bytes, with finite fp16 block scales: [rows, row bytes]."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if qtype == T.Q8_0:
        raw[:, :2] = _fp16_bytes(rng, n)
    elif qtype in (T.Q4_K, T.Q5_K):
        raw[:, 0:2], raw[:, 2:4] = _fp16_bytes(rng, n), _fp16_bytes(rng, n)
    elif qtype == T.Q6_K:
        raw[:, 208:210] = _fp16_bytes(rng, n)
    elif qtype == T.F16:
        raw = _fp16_bytes(rng, n)
    elif qtype == T.F32:
        raw = np.frombuffer(rng.standard_normal(n).astype(np.float32).tobytes(), np.uint8)
    elif qtype == T.BF16:
        raw[:, 1] = (raw[:, 1] & 0x3F) | 0x3C  # finite bfloat16 (exponent below all-ones)
    return np.ascontiguousarray(raw.reshape(rows, -1))


def _reference(raw: np.ndarray, qtype: T, rows: int, cols: int) -> torch.Tensor:
    out = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    return torch.from_numpy(np.array(out, dtype=np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_equals_gguf_dequantize(qtype: T) -> None:
    rows, cols = 5, 512
    raw = _any_valid_blocks(qtype, rows, cols, seed=int(qtype))
    codec = GGUF_CODECS[int(qtype)]
    assert codec.nbytes(rows, cols) == raw.size
    got = codec.decode(torch.from_numpy(raw.reshape(-1).copy()), rows, cols, torch.float32)
    want = _reference(raw, qtype, rows, cols)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)
    # rounded to the compute dtype from the exact float32 value
    bf = codec.decode(torch.from_numpy(raw.reshape(-1).copy()), rows, cols, torch.bfloat16)
    assert torch.equal(bf, want.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_random_blocks_are_valid_and_near_scale(qtype: T) -> None:
    codec = GGUF_CODECS[int(qtype)]
    assert isinstance(codec, GGUFCodec)
    raw = random_blocks(codec, 64, 256, 0.05, torch.Generator().manual_seed(0))
    values = _reference(raw.numpy(), qtype, 64, 256)
    assert torch.equal(codec.decode(raw.reshape(-1), 64, 256, torch.float32), values)
    assert torch.isfinite(values).all()
    assert 0.005 < values.std().item() < 0.1 and abs(values.mean().item()) < 0.01


def test_packed_expert_decodes_each_part_at_its_offset() -> None:
    """An expert packed as gate/up Q4_K and down Q6_K (Q4_K_M) splits into the three matrices,
    in a slot longer than the expert and at a 16-byte-aligned offset of a larger pool."""
    d, i = 256, 512
    codecs = (get_codec("gguf-q4_k"), get_codec("gguf-q4_k"), get_codec("gguf-q6_k"))
    fmt = ExpertFormat(ExpertShape(d, i), torch.float32, codecs)  # type: ignore[arg-type]
    assert fmt.nbytes == 2 * i * (d // 256) * 144 + d * (i // 256) * 210
    pool = torch.zeros(2, fmt.nbytes + 64, dtype=torch.uint8)
    mats = []
    for n, (qtype, (rows, cols)) in enumerate(
        zip((T.Q4_K, T.Q4_K, T.Q6_K), ((i, d), (i, d), (d, i)))
    ):
        raw = _any_valid_blocks(qtype, rows, cols, seed=10 + n)
        fmt.parts(pool[1])[n].copy_(torch.from_numpy(raw.reshape(-1)))
        mats.append(_reference(raw, qtype, rows, cols))
    gate_up, down = fmt.split(pool[1])
    assert torch.equal(gate_up, torch.cat(mats[:2])) and torch.equal(down, mats[2])


def test_sizes_and_partial_blocks() -> None:
    assert get_codec("gguf-q4_k").nbytes(768, 2048) == 768 * 8 * 144
    assert get_codec("gguf-q8_0").nbytes(3, 64) == 3 * 2 * 34
    with pytest.raises(ValueError, match="gguf-q6_k stores rows in blocks of 256 values"):
        get_codec("gguf-q6_k").nbytes(4, 96)


@pytest.mark.parametrize("qtype", [T.IQ2_XS, T.Q4_0, T.Q2_K], ids=lambda t: t.name)
def test_unsupported_type_names_tensor_and_type(qtype: T) -> None:
    with pytest.raises(
        ValueError,
        match=rf"m\.gguf: tensor blk\.3\.ffn_up_exps\.weight is "
        rf"stored as {qtype.name}.*supported: .*Q4_K.*Q6_K.*MXFP4",
    ):
        codec_for(int(qtype), "blk.3.ffn_up_exps.weight", "m.gguf")


def test_mxfp4_transcode_decodes_to_gguf_dequantize() -> None:
    """ggml's block_mxfp4 (any nibbles, every finite scale byte 0..254: subnormal to huge)
    rearranged into Mxfp4Codec's layout keeps the byte count and decodes to exactly what
    gguf.quants.dequantize gives for the stored blocks; the codec the experts keep is MXFP4."""
    rows, cols = 17, 480  # 255 blocks
    rng = np.random.default_rng(39)
    raw = rng.integers(0, 256, (rows * cols // 32, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(255, dtype=np.uint8)
    with np.errstate(over="ignore"):  # scale 254 x 12: inf, in both
        want = _reference(raw.reshape(rows, -1), T.MXFP4, rows, cols)
    flat = torch.from_numpy(raw.reshape(-1).copy())
    encoded = mxfp4_from_ggml(flat, rows, cols)
    assert encoded.numel() == raw.size == MXFP4.nbytes(rows, cols)
    assert torch.equal(MXFP4.decode(encoded, rows, cols, torch.float32), want)
    assert codec_for(int(T.MXFP4), "blk.0.ffn_down_exps.weight") is MXFP4
    with pytest.raises(ValueError, match="no \\[17, 448\\] matrix"):
        mxfp4_from_ggml(flat, rows, 448)
