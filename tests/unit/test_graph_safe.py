"""When a decode step may replay a CUDA graph: the rule is host-side and testable on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from moetier.bench.routing_override import OverrideGate, UniformRouting
from moetier.engine.graphs import graph_safe


def _block(gate: nn.Module, observer: object = None, max_pairs: int = 64) -> SimpleNamespace:
    return SimpleNamespace(gate=gate, route_observer=observer, slot_kernel_max_pairs=max_pairs)


def test_plain_routers_may_replay() -> None:
    assert graph_safe([_block(nn.Linear(4, 8)), _block(nn.Linear(4, 8))], pairs=64)


def test_overridden_routing_runs_eagerly() -> None:
    # ids fed from the host each call: a graph would replay the captured ids forever
    inner = nn.Linear(4, 8, bias=False)
    gate = OverrideGate(inner, UniformRouting(8, 2, seed=0), index=1)
    assert not graph_safe([_block(nn.Linear(4, 8)), _block(gate)], pairs=2)
    ids, w = gate(torch.randn(3, 4))
    assert ids.shape == (3, 2) and torch.allclose(w.sum(-1), torch.ones(3))


def test_observer_or_too_many_pairs_runs_eagerly() -> None:
    assert not graph_safe([_block(nn.Linear(4, 8), observer=print)], pairs=2)
    assert not graph_safe([_block(nn.Linear(4, 8), max_pairs=8)], pairs=9)
    assert graph_safe([_block(nn.Linear(4, 8), max_pairs=8)], pairs=8)
