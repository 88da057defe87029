"""The one-token CPU loop of the MoE block (layers/moe.py) equals the per-pair loop bit for bit:
the same products and the same adds in the same (ascending expert) order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moetier.layers.moe import MoEBlock


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_loop_equals_pair_loop(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    d, inter, k, n_exp = 24, 10, 3, 7
    block = MoEBlock(0, nn.Identity())
    x = torch.randn(1, d, generator=g).to(dtype)
    experts = [1, 4, 6]  # ascending, as the wave is
    routing = [6, 1, 4]  # the token's top-k order: kpos of expert e = routing.index(e)
    kpos = torch.tensor([routing.index(e) for e in experts])
    tokens = torch.zeros(k, dtype=torch.long)
    weights = torch.rand(1, k, generator=g)
    w = [(torch.randn(2 * inter, d, generator=g) / d**0.5).to(dtype) for _ in range(n_exp)]
    v = [(torch.randn(d, inter, generator=g) / inter**0.5).to(dtype) for _ in range(n_exp)]
    batch = SimpleNamespace(gate_up=[w[e] for e in experts], down=[v[e] for e in experts])
    spans = [(i, i + 1) for i in range(k)]
    want = torch.zeros_like(x)
    block.one_token_loop = False  # the per-pair form: gather rows, scatter results
    block._wave_loop(x, want, batch, spans, tokens, kpos, weights)  # type: ignore[arg-type]
    block.one_token_loop = True
    got = torch.zeros_like(x)
    block._wave_loop(x, got, batch, spans, tokens, kpos, weights)  # type: ignore[arg-type]
    assert torch.equal(got, want)
    # and the weights went to the right experts: swapping two routing slots changes the result
    other = torch.zeros_like(x)
    block._wave_loop(x, other, batch, spans, tokens, kpos.flip(0), weights)  # type: ignore[arg-type]
    assert not torch.equal(other, want)
