"""Trace file round trip, bad input, and the synthetic checkpoint cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetier.bench.synthetic import MARKER, ensure_synthetic, synthetic_dir
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord, read_trace, write_trace
from moetier.errors import ConfigError


def _trace() -> RoutingTrace:
    header = TraceHeader(3, 8, 2, [1, 2], 4096)
    recs = [
        TraceRecord(0, 1, [0, 0, 1], [[3, 1], [0, 7], [2, 3]]),
        TraceRecord(0, 2, [0, 0, 1], [[5, 4], [4, 6], [1, 0]]),
        TraceRecord(1, 1, [0, 1], [[3, 2], [7, 1]]),
    ]
    return RoutingTrace(header, recs)


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_trace_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    write_trace(path, _trace())
    back = read_trace(path)
    assert back == _trace()
    if name.endswith(".jsonl"):
        first = json.loads(path.read_text().splitlines()[0])
        assert first == {
            "format": "moetier-trace",
            "version": 1,
            "num_layers": 3,
            "num_experts": 8,
            "top_k": 2,
            "moe_layers": [1, 2],
            "expert_bytes": 4096,
        }
        assert json.loads(path.read_text().splitlines()[3]) == {
            "step": 1,
            "layer": 1,
            "requests": [0, 1],
            "experts": [[3, 2], [7, 1]],
        }


def test_trace_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "other"}\n')
    with pytest.raises(ConfigError, match="not a moetier-trace"):
        read_trace(bad)
    bad.write_text(json.dumps(_trace().header.to_json()) + '\n{"step": 0, "layer": 1}\n')
    with pytest.raises(ConfigError, match=":2: malformed"):
        read_trace(bad)


def test_synthetic_cached_and_redone_when_partial() -> None:
    path = ensure_synthetic("tiny-qwen3", 1, seed=5)
    assert path == synthetic_dir("tiny-qwen3", 1, 5) and (path / MARKER).exists()
    stamp = (path / "layer-000.safetensors").stat().st_mtime_ns
    assert ensure_synthetic("tiny-qwen3", 1, seed=5) == path  # reused
    assert (path / "layer-000.safetensors").stat().st_mtime_ns == stamp
    (path / MARKER).unlink()  # an interrupted write: no marker -> regenerated
    ensure_synthetic("tiny-qwen3", 1, seed=5)
    assert (path / MARKER).exists()
