"""The routing override computes exactly the chosen experts, with real-router weights."""

from __future__ import annotations

import torch
from torch import nn

from moetier.bench.routing_override import (
    OverrideGate,
    TraceRouting,
    UniformRouting,
    fit_row,
    install,
    uniform_ids,
)
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()


def test_uniform_picks_exactly_the_seeded_experts() -> None:
    src = UniformRouting(num_experts=8, top_k=3, seed=7)
    gate = OverrideGate(_Gate(), src, index=1)
    x = torch.randn(5, 4)
    ids0, w0 = gate(x)
    ids1, _ = gate(x)
    assert torch.equal(ids0, uniform_ids(7, 1, 0, 5, 8, 3))
    assert torch.equal(ids1, uniform_ids(7, 1, 1, 5, 8, 3))  # next call, next draw
    assert all(len(set(row)) == 3 for row in ids0.tolist())
    probs = torch.softmax(x @ gate.inner.weight.T, dim=-1).gather(1, ids0)
    torch.testing.assert_close(w0, probs / probs.sum(-1, keepdim=True))
    src.reset()
    assert torch.equal(gate(x)[0], ids0)  # reset replays the same draws


def test_trace_replay_cycles_layers_and_tokens() -> None:
    header = TraceHeader(2, 16, 2, [0, 1], 0)
    recs = [
        TraceRecord(0, 0, [0, 0], [[1, 2], [3, 4]]),
        TraceRecord(0, 1, [0, 0], [[5, 6], [7, 9]]),
        TraceRecord(1, 0, [0], [[10, 2]]),
    ]
    src = TraceRouting(RoutingTrace(header, recs), num_experts=8, top_k=2, label="t")
    # model layer 2 replays trace layer 0 (2 mod 2); ids mod 8; 4 tokens wrap the 3-row stream
    assert src.ids(2, 4).tolist() == [[1, 2], [3, 4], [2, 3], [1, 2]]
    assert src.ids(2, 1).tolist() == [[3, 4]]
    assert src.ids(1, 2).tolist() == [[5, 6], [7, 1]]
    assert fit_row([3, 11, 3], 8, 3) == [3, 4, 5]  # 11 mod 8 = 3: deduplicated, then padded


def test_install_and_undo() -> None:
    blocks = [_Block(), _Block()]
    originals = [b.gate for b in blocks]
    undo = install(blocks, UniformRouting(8, 2, 0))
    assert all(isinstance(b.gate, OverrideGate) for b in blocks)
    assert [b.gate.index for b in blocks] == [0, 1]  # type: ignore[union-attr]
    undo()
    assert [b.gate for b in blocks] == originals
