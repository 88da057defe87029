"""Expert placement: exact owners for round-robin and trace-balanced placement, and the errors
that stop a bad setting before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord, write_trace
from moetier.config import ParallelConfig
from moetier.errors import ConfigError
from moetier.parallel.group import checkpoint_fingerprint
from moetier.parallel.placement import Placement, make_placement, trace_counts


def test_round_robin_owners_with_experts_not_divisible() -> None:
    p = Placement.round_robin([1, 3], num_experts=8, world=3)
    assert p.owner == {1: [0, 1, 2, 0, 1, 2, 0, 1], 3: [0, 1, 2, 0, 1, 2, 0, 1]}
    assert [p.experts_of(r, 3) for r in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert p.counts() == [6, 6, 4]
    assert p.owns(2, 1, 5) and not p.owns(0, 1, 5)


def test_balanced_places_most_used_first_on_the_least_loaded_rank() -> None:
    counts = {0: [10, 50, 0, 20, 40, 5, 30, 1]}
    p = Placement.balanced(counts, [0, 2], num_experts=8, world=2)
    # by use, cap 4 a rank: e1 50 -> r0; e4 40 -> r1; e6 30 -> r1 (40 < 50); e3 20 -> r0
    # (50 < 70); e0 10 -> r0 (70 = 70, each holds 2: the lower rank); e5 5 -> r1 (70 < 80);
    # e7 1 -> r1 (75 < 80); e2 0 -> r0 (r1 holds 4)
    assert p.owner[0] == [0, 0, 0, 0, 1, 1, 1, 1]
    loads = [sum(c for c, r in zip(counts[0], p.owner[0]) if r == rank) for rank in range(2)]
    assert loads == [80, 76]
    assert p.owner[2] == Placement.round_robin([2], 8, 2).owner[2]  # unseen layer: even split
    assert p.counts() == [8, 8]


def test_trace_counts_and_balanced_from_a_trace(tmp_path: Path) -> None:
    header = TraceHeader(num_layers=2, num_experts=4, top_k=2, moe_layers=[0, 1])
    records = [
        TraceRecord(0, 0, [1, 1], [[0, 1], [0, 2]]),
        TraceRecord(0, 1, [1, 1], [[3, 1], [3, 2]]),
        TraceRecord(1, 0, [1], [[0, 3]]),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, RoutingTrace(header, records))
    assert trace_counts(path, 4) == {0: [3, 1, 1, 1], 1: [0, 1, 1, 2]}
    p = make_placement("balanced", [0, 1], 4, 2, path)
    # layer 0 uses [3, 1, 1, 1]: e0 -> r0, e1 -> r1, e2 -> r1 (1 < 3), e3 -> r0 (r1 holds 2);
    # layer 1 uses [0, 1, 1, 2]: e3 -> r0, e1 -> r1, e2 -> r1 (1 < 2), e0 -> r0
    assert p.owner == {0: [0, 1, 1, 0], 1: [0, 1, 1, 0]}
    with pytest.raises(ConfigError, match="recorded with 4 experts a layer; this model has 8"):
        trace_counts(path, 8)


def test_parallel_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expert_parallel_size must be an integer >= 1"):
        ParallelConfig(0)
    with pytest.raises(ConfigError, match="unknown expert placement 'random'"):
        ParallelConfig(2, "random")
    with pytest.raises(ConfigError, match="pass placement_trace"):
        ParallelConfig(2, "balanced")
    with pytest.raises(ConfigError, match="no-such.jsonl: no such file"):
        ParallelConfig(2, "balanced", str(tmp_path / "no-such.jsonl"))


def test_checkpoint_fingerprint_tells_checkpoints_apart(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, size in ((a, 10), (b, 11)):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "qwen3_moe"}')
        (d / "model.safetensors").write_bytes(b"\0" * size)
    assert checkpoint_fingerprint(str(a)) != checkpoint_fingerprint(str(b))
    (b / "model.safetensors").write_bytes(b"\1" * 10)  # same names and sizes: same print
    assert checkpoint_fingerprint(str(a)) == checkpoint_fingerprint(str(b))


def test_rank_counters_reach_metrics_with_a_rank_label() -> None:
    import prometheus_client

    from moetier.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.update_engine(
        {
            "device_hits": 5.0,
            "rank0.device_hits": 3.0,
            "rank1.device_hits": 2.0,
            "rank1.bytes_host_to_device": 4096.0,
            "rank0.owned_experts": 8.0,
            "rank1.owned_experts": 8.0,
            "rank1.collective_s": 0.25,
            "rankx": 1.0,
            "rank0.unknown_key": 1.0,
        }  # fmt: skip
    )
    text = prometheus_client.generate_latest(metrics.registry).decode()
    lines = {ln for ln in text.splitlines() if ln.startswith("moetier:rank_")}
    assert lines == {
        'moetier:rank_expert_hits_total{model_name="m",rank="0",tier="device"} 3.0',
        'moetier:rank_expert_hits_total{model_name="m",rank="1",tier="device"} 2.0',
        'moetier:rank_expert_bytes_total{model_name="m",path="host_to_device",rank="1"} 4096.0',
        'moetier:rank_owned_experts{model_name="m",rank="0"} 8.0',
        'moetier:rank_owned_experts{model_name="m",rank="1"} 8.0',
        'moetier:rank_collective_seconds_total{model_name="m",rank="1"} 0.25',
    }


def test_cli_summary_names_each_rank() -> None:
    from moetier.cli import ranks_summary

    assert ranks_summary({}) == ""
    rows = [
        {"rank": 0, "device_slots": 60, "owned_experts": 240, "device_hit_rate": 0.543,
         "collective_s": 0.7854},
        {"rank": 1, "device_slots": 60, "owned_experts": 240, "device_hit_rate": 0.525,
         "collective_s": 0.8131},
    ]  # fmt: skip
    assert ranks_summary({"ranks": rows}) == (
        " | 2 ranks (figures above: rank 0's): rank 0 60/240 slots, hits 54.3%, exchange "
        "0.785 s; rank 1 60/240 slots, hits 52.5%, exchange 0.813 s"
    )
