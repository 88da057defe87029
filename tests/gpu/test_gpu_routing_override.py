"""The bench's uniform routing drawn on CUDA and trace replay on CUDA
(bench/routing_override.py): ids stay on the device,
every row holds K distinct experts, one (seed, layer, call) repeats exactly, and a gate over a
CUDA router returns the source's ids, staged or not. Run on the GPU machine with
`python3 -m pytest -m gpu tests/gpu/test_gpu_routing_override.py`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from moetier.bench.routing_override import (
    OverrideGate,
    TraceRouting,
    UniformRouting,
    make_source,
    uniform_ids,
)
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord, write_trace

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_draws_are_distinct_repeatable_and_stay_on_the_device() -> None:
    ids = uniform_ids(3, 5, 0, 2048, 64, 6, "cuda")
    assert ids.device.type == "cuda" and ids.shape == (2048, 6) and ids.dtype == torch.long
    rows = ids.sort(dim=1).values
    assert bool((rows[:, 1:] != rows[:, :-1]).all())  # K distinct experts a token
    assert int(ids.min()) >= 0 and int(ids.max()) < 64
    assert torch.equal(ids, uniform_ids(3, 5, 0, 2048, 64, 6, "cuda"))
    assert not torch.equal(ids, uniform_ids(3, 5, 1, 2048, 64, 6, "cuda"))  # next call
    assert not torch.equal(ids, uniform_ids(3, 6, 0, 2048, 64, 6, "cuda"))  # next layer
    counts = torch.bincount(ids.flatten(), minlength=64).float()
    assert float(counts.min()) > 0.5 * float(counts.mean())  # every expert drawn about equally


def test_gate_on_cuda_returns_the_device_draw_staged_or_not() -> None:
    src = make_source("uniform", 8, 2, 5, torch.device("cuda"))
    assert isinstance(src, UniformRouting) and "drawn on cuda" in src.label
    gate = OverrideGate(nn.Linear(4, 8, bias=False).cuda(), src, index=3)
    x = torch.randn(3, 4, device="cuda")
    ids, w = gate(x)
    assert torch.equal(ids, uniform_ids(5, 3, 0, 3, 8, 2, "cuda"))
    torch.testing.assert_close(w.sum(dim=-1), torch.ones(3, device="cuda"))
    gate.stage(3, x.device, rows=4)  # a padded graph's rows: the pad row gets experts 0, 1
    assert torch.equal(gate.staged[:3], uniform_ids(5, 3, 1, 3, 8, 2, "cuda"))
    assert gate.staged[3].tolist() == [0, 1]


def test_trace_streams_stay_on_the_device_and_match_the_host_replay(tmp_path: Path) -> None:
    """A trace replayed on CUDA gives exactly the host replay's ids, call after call (wrapping
    around the stream), computed on the device: no host tensor is copied in per layer."""
    rng = random.Random(0)
    header = TraceHeader(num_layers=2, num_experts=8, top_k=2, moe_layers=[0, 1])
    recs = [
        TraceRecord(s, la, [0] * 5, [rng.sample(range(8), 2) for _ in range(5)])
        for s in range(4)
        for la in (0, 1)
    ]
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, RoutingTrace(header, recs))
    host = make_source(f"trace:{path}", 6, 2, 0, "cpu")
    dev = make_source(f"trace:{path}", 6, 2, 0, torch.device("cuda"))
    assert isinstance(dev, TraceRouting) and all(s.is_cuda for s in dev.streams)
    for index, tokens in [(0, 7), (1, 7), (0, 15), (3, 1)]:
        got = dev.ids(index, tokens)
        assert got.is_cuda and torch.equal(got.cpu(), host.ids(index, tokens))
    gate = OverrideGate(nn.Linear(4, 6, bias=False).cuda(), dev, index=1)
    gate.stage(2, torch.device("cuda"))
    assert gate.staged is not None and torch.equal(gate.staged.cpu(), host.ids(1, 2))
