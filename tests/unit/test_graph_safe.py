"""When a decode step may replay a CUDA graph, and how a router fed from the host is staged for
one: host-side rules, testable on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from moetier.bench.routing_override import OverrideGate, UniformRouting, uniform_ids
from moetier.engine.graphs import graph_safe


def _block(
    gate: nn.Module, observer: object = None, max_pairs: int = 64, grouped: bool = False
) -> SimpleNamespace:
    return SimpleNamespace(
        gate=gate, route_observer=observer, slot_kernel_max_pairs=max_pairs, grouped_kernel=grouped
    )


class _HostGate(nn.Module):
    host_routing = True  # ids from the host each call, and no way to stage them


def test_plain_routers_may_replay() -> None:
    assert graph_safe([_block(nn.Linear(4, 8)), _block(nn.Linear(4, 8))], pairs=64)


def test_host_fed_routers_replay_only_when_they_can_be_staged() -> None:
    gate = OverrideGate(nn.Linear(4, 8, bias=False), UniformRouting(8, 2, seed=0), index=1)
    assert graph_safe([_block(nn.Linear(4, 8)), _block(gate)], pairs=2)
    assert not graph_safe([_block(nn.Linear(4, 8)), _block(_HostGate())], pairs=2)


def test_observer_only_in_piecewise_graphs_and_pairs_must_fit() -> None:
    assert not graph_safe([_block(nn.Linear(4, 8), observer=print)], pairs=2)
    assert graph_safe([_block(nn.Linear(4, 8), observer=print)], pairs=2, piecewise=True)
    assert not graph_safe([_block(nn.Linear(4, 8), max_pairs=8)], pairs=9)
    assert graph_safe([_block(nn.Linear(4, 8), max_pairs=8)], pairs=8)
    # the grouped kernel takes any number of pairs beyond the slot kernel's
    assert graph_safe([_block(nn.Linear(4, 8), max_pairs=8, grouped=True)], pairs=9)


def test_staged_ids_are_this_calls_ids_in_a_fixed_buffer() -> None:
    gate = OverrideGate(nn.Linear(4, 8, bias=False), UniformRouting(8, 2, seed=5), index=3)
    x = torch.randn(3, 4)
    first, _ = gate(x)  # call 0, drawn on the host
    gate.stage(3, torch.device("cpu"))  # call 1, drawn now into the buffer for 3 tokens
    buf = gate.staged
    assert buf is not None
    staged_a, w = gate(x)
    staged_b, _ = gate(x)  # a replay reads the same buffer: no new draw
    assert staged_a.data_ptr() == staged_b.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(staged_a, uniform_ids(5, 3, 1, 3, 8, 2))
    torch.testing.assert_close(first, uniform_ids(5, 3, 0, 3, 8, 2))
    torch.testing.assert_close(w.sum(-1), torch.ones(3))
    gate.stage(3, torch.device("cpu"))  # call 2 reuses the buffer (a graph reads its address)
    assert gate.staged is not None and gate.staged.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(gate.staged, uniform_ids(5, 3, 2, 3, 8, 2))
    gate.unstage()
    third, _ = gate(x)  # back to per-call host draws: call 3
    torch.testing.assert_close(third, uniform_ids(5, 3, 3, 3, 8, 2))
