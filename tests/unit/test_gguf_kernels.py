"""GGUF slots read in place by the expert kernels: the slot kernel and the grouped kernel
(Triton's interpreter on the CPU) equal the reference on the torch decoders' exact
dequantization (weights/gguf_quants.py) of random valid blocks: Q8_0, Q4_K_M (gate/up Q4_K,
down Q6_K) and Q5_K."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.slot_layout import Q4_K, Q6_K, Q8_0, slot_layout
from moetier.weights.formats import ExpertFormat, ExpertPacking, ExpertShape, get_codec
from tests.unit.test_expert_ffn import _run_in_interpreter


def test_gguf_layouts_per_layer() -> None:
    """Q4_K_M: the layers whose down is Q6_K and those whose down is Q4_K get their own
    layouts; the slot (the largest layer's expert) holds either."""
    q4, q6 = get_codec("gguf-q4_k"), get_codec("gguf-q6_k")
    shape = ExpertShape(256, 512)
    big = ExpertFormat(shape, torch.float32, (q4, q4, q6))
    small = ExpertFormat(shape, torch.float32, (q4, q4, q4))
    packing = ExpertPacking({0: big, 1: small})
    layouts = slot_layout(packing)
    assert layouts is not None
    gate = 512 * 144  # 512 rows of one 256-value block
    assert (layouts[0].up, layouts[0].down) == (gate, 2 * gate) == (layouts[1].up, layouts[1].down)
    assert (layouts[0].gate_up_format, layouts[0].down_format) == (Q4_K, Q6_K)
    assert (layouts[1].gate_up_format, layouts[1].down_format) == (Q4_K, Q4_K)
    assert packing.nbytes == 2 * gate + 256 * 2 * 210
    q8 = get_codec("gguf-q8_0")
    layout = slot_layout(
        ExpertPacking({0: ExpertFormat(ExpertShape(64, 32), torch.float32, (q8,) * 3)})
    )
    assert layout is not None and layout[0].gate_up_format == layout[0].down_format == Q8_0


_GGUF_KERNELS = """
import torch
from moetier.kernels.expert_ffn import expert_ffn, expert_ffn_reference
from moetier.kernels.grouped_ffn import grouped_ffn, grouped_ffn_reference
from moetier.kernels.slot_layout import slot_layout
from moetier.weights.formats import ExpertFormat, ExpertPacking, ExpertShape, get_codec
from moetier.weights.gguf_quants import random_blocks

g = torch.Generator().manual_seed(0)
s = e = 4
cases = [
    ((64, 32), ("gguf-q8_0",) * 3),
    ((256, 256), ("gguf-q4_k", "gguf-q4_k", "gguf-q6_k")),
    ((256, 256), ("gguf-q5_k",) * 3),
    ((512, 256), ("gguf-q6_k", "gguf-q6_k", "gguf-q4_k")),  # two super-blocks per gate/up row
]
for (d, i), names in cases:
    codecs = tuple(get_codec(n) for n in names)
    fmt = ExpertFormat(ExpertShape(d, i), torch.float32, codecs)
    packing = ExpertPacking({0: fmt})
    layout = slot_layout(packing)[0]
    pool = torch.zeros(s, packing.numel, dtype=torch.uint8)
    dense = torch.empty(s, 3 * i * d)
    for slot in range(s):
        for part, c, (rows, cols) in zip(fmt.parts(pool[slot]), codecs, ((i, d), (i, d), (d, i))):
            part.copy_(random_blocks(c, rows, cols, 2.0 / cols**0.5, g).reshape(-1))
        gate_up, down = fmt.split(pool[slot])
        dense[slot] = torch.cat([gate_up.flatten(), down.flatten()])
    tol = dict(rtol=1e-5, atol=1e-5)
    x = torch.randn(2, d, generator=g)
    slots = torch.stack([torch.randperm(s, generator=g)[:2] for _ in range(2)]).sort(-1).values
    w = torch.rand(2, 2, generator=g)
    want = expert_ffn_reference(x, dense, slots, w, i)
    assert torch.equal(expert_ffn_reference(x, pool, slots, w, i, layout), want), names
    torch.testing.assert_close(expert_ffn(x, pool, slots, w, i, layout), want, **tol)
    x = torch.randn(5, d, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(5)]).sort(-1).values
    slots = experts.clone().to(torch.int32)
    slots[0, 1] = -1
    w = torch.rand(5, 2, generator=g)
    want = grouped_ffn_reference(x, dense, slots, w, i)
    got = grouped_ffn(x, pool, slots, w, i, e, experts=experts, layout=layout)
    torch.testing.assert_close(got, want, **tol)
print("ok")
"""


def test_gguf_kernels_match_reference_in_interpreter() -> None:
    pytest.importorskip("triton")
    _run_in_interpreter(_GGUF_KERNELS)
