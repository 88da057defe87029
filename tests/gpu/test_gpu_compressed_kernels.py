"""The expert kernels on compressed slots on CUDA (FP8 block-scaled, GGUF Q8_0 / Q4_K_M / Q5_K /
Q6_K, MXFP4) equal the reference on the decoded slots, bf16, decode- and prefill-sized calls, at the
Qwen3-30B-A3B expert shape (the block formats' real row lengths). Run on the GPU machine with
`python3 -m pytest -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.expert_ffn import expert_ffn, expert_ffn_reference
from moetier.kernels.grouped_ffn import grouped_ffn, grouped_ffn_reference
from moetier.kernels.slot_layout import slot_layout
from moetier.weights.formats import (
    ExpertFormat,
    ExpertPacking,
    ExpertShape,
    Fp8BlockCodec,
    MatrixCodec,
    get_codec,
)
from moetier.weights.gguf_quants import random_blocks
from moetier.weights.mxfp4 import random_encoded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

D, INTER, SLOTS = 2048, 768, 12
FORMATS = {
    "fp8": (Fp8BlockCodec(),) * 3,
    "q8_0": ("gguf-q8_0",) * 3,
    "q4_k_m": ("gguf-q4_k", "gguf-q4_k", "gguf-q6_k"),
    "q5_k": ("gguf-q5_k",) * 3,
    "mxfp4": ("mxfp4",) * 3,
}


def _pool(spec: tuple) -> tuple[torch.Tensor, torch.Tensor, object]:
    g = torch.Generator().manual_seed(0)
    codecs: tuple[MatrixCodec, ...] = tuple(get_codec(c) if isinstance(c, str) else c for c in spec)
    fmt = ExpertFormat(ExpertShape(D, INTER), torch.bfloat16, codecs)  # type: ignore[arg-type]
    packing = ExpertPacking({0: fmt})
    pool = torch.zeros(SLOTS, packing.numel, dtype=torch.uint8)
    dims = ((INTER, D), (INTER, D), (D, INTER))
    for s in range(SLOTS):
        for part, c, (rows, cols) in zip(fmt.parts(pool[s]), codecs, dims):
            if isinstance(c, Fp8BlockCodec):
                w = (torch.randn(rows, cols, generator=g) * 64).clamp(-440, 440)
                scale = torch.full(c.scale_shape(rows, cols), 1 / (64 * cols**0.5))
                part.copy_(c.encode(w.to(torch.float8_e4m3fn), scale))
            elif c.name == "mxfp4":
                part.copy_(random_encoded(rows, cols, 2.0 / cols**0.5, g))
            else:
                part.copy_(random_blocks(c, rows, cols, 2.0 / cols**0.5, g).reshape(-1))
    layouts = slot_layout(packing)
    assert layouts is not None
    rows = [torch.cat([t.flatten() for t in fmt.split(pool[s])]) for s in range(SLOTS)]
    dense = torch.stack(rows)
    return pool.cuda(), dense.cuda(), layouts[0]


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("tokens", [1, 4, 96])
def test_compressed_kernels_match_reference(name: str, tokens: int) -> None:
    pool, dense, layout = _pool(FORMATS[name])
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, D, generator=g, device="cuda").to(torch.bfloat16)
    ids = (
        torch.stack([torch.randperm(SLOTS, generator=g, device="cuda")[:8] for _ in range(tokens)])
        .sort(-1)
        .values
    )
    w = torch.rand(tokens, 8, generator=g, device="cuda")
    slots = ids.to(torch.int32)
    if tokens * 8 <= 128:
        got = expert_ffn(x, pool, slots, w, INTER, layout)  # type: ignore[arg-type]
        want = expert_ffn_reference(x, dense, slots, w, INTER)
    else:
        got = grouped_ffn(x, pool, slots, w, INTER, SLOTS, experts=ids, layout=layout)  # type: ignore[arg-type]
        want = grouped_ffn_reference(x, dense, slots, w, INTER)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 2**-6, f"{name}: largest difference {err:.3g} of the output's scale"
