"""The one-token CPU loop of the MoE block (layers/moe.py) equals the per-pair loop bit for bit:
the same products and the same adds in the same (ascending expert) order. With late reads the
loop computes the experts in place first, waits for each late one before reading its weights,
and still adds the terms in ascending expert order (bit-equal again); it splits (decodes, for
a compressed format) each expert only once its read is done."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moetier.layers.moe import MoEBlock


def _batch(gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> SimpleNamespace:
    """The parts of an ExpertBatch the loop reads, no late reads."""
    n = len(gate_up)
    return SimpleNamespace(
        weights=lambda i: (gate_up[i], down[i]),
        experts=list(range(n)),  # ids the expert_mlp hook gets (the default ignores them)
        late={},
        compute_order=lambda: list(range(n)),
        ready=lambda i: None,
    )


class LateBatch:
    """Experts whose weights arrive only when `ready(i)` is called (NaN until then), as with
    late reads; records the order of the calls. Asking for an expert's weights before it is
    ready is an error: a compressed expert would be decoded from bytes not yet read."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], late: set) -> None:
        self.want = list(zip(gate_up, down))
        self.gate_up = [g.clone() for g in gate_up]
        self.down = [d.clone() for d in down]
        self.late = {i: 100 + i for i in late}  # index -> slot
        for i in late:
            self.gate_up[i].fill_(float("nan"))
            self.down[i].fill_(float("nan"))
        self.calls: list[int] = []
        self.experts = list(range(len(gate_up)))

    def compute_order(self) -> list[int]:
        n = len(self.gate_up)
        return [i for i in range(n) if i not in self.late] + sorted(self.late)

    def weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert i not in self.late, f"expert {i} decoded before its read was done"
        return self.gate_up[i], self.down[i]

    def ready(self, i: int) -> None:
        self.calls.append(i)
        if self.late.pop(i, None) is not None:
            self.gate_up[i].copy_(self.want[i][0])
            self.down[i].copy_(self.want[i][1])


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
    batch = _batch([w[e] for e in experts], [v[e] for e in experts])
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


@pytest.mark.parametrize("one_token", [True, False])
def test_late_experts_are_waited_for_and_added_in_ascending_order(one_token: bool) -> None:
    g = torch.Generator().manual_seed(5)
    d, inter, k, n_exp, tokens_n = 16, 8, 2, 5, 1 if one_token else 3
    block = MoEBlock(0, nn.Identity())
    block.one_token_loop = one_token
    x = torch.randn(tokens_n, d, generator=g)
    w = [torch.randn(2 * inter, d, generator=g) / d**0.5 for _ in range(n_exp)]
    v = [torch.randn(d, inter, generator=g) / inter**0.5 for _ in range(n_exp)]
    # every token routes to its own 2 of experts 0..3; pairs grouped by expert, ascending
    routes = [[0, 2], [3, 0], [2, 1]][:tokens_n]
    experts = sorted({e for r in routes for e in r})
    pairs = sorted((e, t, r.index(e)) for t, r in enumerate(routes) for e in r)
    tokens = torch.tensor([t for _, t, _ in pairs])
    kpos = torch.tensor([p for _, _, p in pairs])
    spans, at = [], 0
    for e in experts:
        n = sum(1 for p in pairs if p[0] == e)
        spans.append((at, at + n))
        at += n
    weights = torch.rand(tokens_n, k, generator=g)
    gate_up, down = [w[e] for e in experts], [v[e] for e in experts]
    want = torch.zeros_like(x)
    block._wave_loop(x, want, _batch(gate_up, down), spans, tokens, kpos, weights)  # type: ignore[arg-type]
    late = LateBatch(gate_up, down, late={0, 2} & set(range(len(experts))))
    got = torch.zeros_like(x)
    block._wave_loop(x, got, late, spans, tokens, kpos, weights)  # type: ignore[arg-type]
    assert torch.equal(got, want)  # NaN would leak in if a late expert were read before ready
    hits = [i for i in range(len(experts)) if i not in (0, 2)]
    assert late.calls == hits + [0, 2][: len(experts) - len(hits)]
