"""Trace format version 2 (recorded next-layer predictions) and the bench's `trace` predictor."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from moetier.bench.replay import predictions, score_predictions
from moetier.bench.routing_override import TraceRouting, install
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord, read_trace, write_trace
from moetier.bench.trace_prefetch import (
    TracePredictor,
    check_sources,
    rank_union,
    recorded_predictions,
    registered,
)
from moetier.cli import main
from moetier.errors import ConfigError
from moetier.offload.predict import PREDICTORS
from moetier.offload.prefetcher import Prefetcher


def v2_trace() -> RoutingTrace:
    """2 MoE layers (ids 0, 1) x 16 experts, top-2; layer 0's lines predict layer 1's."""
    header = TraceHeader(2, 16, 2, [0, 1], 4096)
    recs = [
        TraceRecord(0, 0, [0, 0, 0], [[1, 2], [3, 4], [5, 6]], [[9, 3], [3, 12], [12, 5]]),
        TraceRecord(0, 1, [0, 0, 0], [[3, 12], [3, 5], [12, 9]]),  # last layer: none
        TraceRecord(1, 0, [0], [[0, 1]], [[6, 7]]),
        TraceRecord(1, 1, [0], [[6, 2]]),
    ]
    return RoutingTrace(header, recs)


def test_v1_file_still_reads(tmp_path: Path) -> None:
    """A file as version 1 writers wrote it: same records, no predictions, written back as 1."""
    path = tmp_path / "v1.jsonl"
    head = {"format": "moetier-trace", "version": 1, "num_layers": 2, "num_experts": 16}
    head |= {"top_k": 2, "moe_layers": [0, 1], "expert_bytes": 4096}
    line = {"step": 0, "layer": 0, "requests": [0, 1], "experts": [[1, 2], [3, 4]]}
    path.write_text(json.dumps(head) + "\n" + json.dumps(line) + "\n")
    trace = read_trace(path)
    assert trace.records == [TraceRecord(0, 0, [0, 1], [[1, 2], [3, 4]])]
    assert trace.records[0].predicted is None and trace.version == 1
    write_trace(tmp_path / "back.jsonl", trace)
    assert (tmp_path / "back.jsonl").read_text().splitlines() == [
        json.dumps(head),
        json.dumps(line, separators=(",", ":")),
    ]


def test_committed_v1_trace_header() -> None:
    with gzip.open("bench/traces/demo-128x8.jsonl.gz", "rt") as f:
        head, first = json.loads(f.readline()), json.loads(f.readline())
    assert head["version"] == 1 and "predicted" not in first


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_v2_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    write_trace(path, v2_trace())
    back = read_trace(path)
    assert back == v2_trace() and back.version == 2
    assert back.records[0].predicted == [[9, 3], [3, 12], [12, 5]]
    assert back.records[1].predicted is None
    opener: Any = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [json.loads(x) for x in f]
    assert lines[0]["version"] == 2
    assert lines[1]["predicted"] == [[9, 3], [3, 12], [12, 5]]
    assert "predicted" not in lines[2]  # the last MoE layer's line omits it


def test_bad_predictions_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    head = v2_trace().header.to_json(1)
    line = {"step": 0, "layer": 0, "requests": [0], "experts": [[1, 2]], "predicted": [[3, 4]]}
    path.write_text(json.dumps(head) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=":2: `predicted` in a version 1 trace"):
        read_trace(path)
    line["predicted"] = [[3, 4], [5, 6]]
    path.write_text(json.dumps(v2_trace().header.to_json(2)) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=":2: predicted and experts differ"):
        read_trace(path)
    path.write_text(json.dumps({**head, "version": 3}) + "\n")
    with pytest.raises(ConfigError, match="not a moetier-trace version 1 or 2"):
        read_trace(path)


def test_rank_union_counts_then_first_appearance() -> None:
    # 3 twice, 12 twice (3 seen first), then 9 and 5 once each in order seen
    assert rank_union([[9, 3], [3, 12], [12, 5]]) == [3, 12, 9, 5]
    assert rank_union([[2, 2, 1]]) == [2, 1]  # a row counts an id once
    assert rank_union([]) == []


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))


class _Block(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate = _Gate()


def test_trace_predictor_follows_the_replayed_rows() -> None:
    """Model MoE layers 1, 3, 5, 7 (8 experts, top-2) replay the 2-layer trace: index i uses
    trace layer i mod 2; ids mod 8, deduplicated, padded; the predictions ride the same
    cursor. Trace layer 0's predicted stream, mapped: [1,3] [3,4] [4,5] [6,7]."""
    blocks = [_Block(la) for la in (1, 3, 5, 7)]
    source = TraceRouting(v2_trace(), num_experts=8, top_k=2, label="t")
    install(blocks, source)
    pred = TracePredictor.from_blocks(blocks)
    assert pred.name == "trace" and not pred.needs_hidden

    def call(index: int, tokens: int) -> list[int]:
        block = blocks[index]
        ids = block.gate(torch.randn(tokens, 4))[0]
        pred.observe(block.layer, ids.flatten().tolist())
        return pred.predict(block.layer)

    # index 0, rows 0-1: [1,3] [3,4] -> 3 twice, then 1, 4 in order seen
    assert call(0, 2) == [3, 1, 4]
    assert pred.predict(1, limit=2) == [3, 1] and pred.predict(1, ahead=2) == []
    # rows 2, 3, then 0 again (the stream wraps): all once, in token order
    assert call(0, 3) == [4, 5, 6, 7, 1, 3]
    assert call(1, 2) == []  # trace layer 1 has no predictions
    assert call(2, 1) == [1, 3]  # trace layer 0 again (2 mod 2), its own cursor: row 0
    assert call(3, 4) == []  # the model's last MoE layer: its next is the next step's
    source.reset()
    assert source.predicted(0) == []  # nothing replayed since the reset
    assert call(0, 1) == [1, 3]


def test_trace_predictor_without_a_trace_gate_predicts_nothing() -> None:
    blocks = [_Block(0), _Block(1)]
    pred = TracePredictor.from_blocks(blocks)
    pred.observe(0, [1, 2])
    assert pred.predict(0) == []  # the model's own router: e.g. the bench's greedy check


def test_replay_scores_recorded_predictions_exactly() -> None:
    trace = v2_trace()
    preds = recorded_predictions(trace)
    # after a layer-0 call: its rows' union for layer 1; after a layer-1 call: the next step's
    # layer 0, which the recording cannot predict
    assert preds == [(1, [3, 12, 9, 5]), (0, []), (1, [6, 7]), (0, [])]
    assert predictions(trace, "trace") == preds
    score = score_predictions(trace.records, preds)
    # call 0 -> call 1 {3, 5, 9, 12}: 4 of 4; call 1 -> call 2 {0, 1}: 0 of 0 predicted;
    # call 2 -> call 3 {2, 6}: 1 of 2
    assert (score.predicted, score.actual, score.correct) == (6, 8, 5)
    assert score.by_layer == {0: (0, 2, 0), 1: (6, 6, 5)}


def test_replay_trace_predictor_needs_a_v2_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v1 = RoutingTrace(v2_trace().header, [TraceRecord(0, 0, [0], [[1, 2]])])
    with pytest.raises(ConfigError, match="record-trace --predictions"):
        recorded_predictions(v1)
    write_trace(tmp_path / "v2.jsonl", v2_trace())
    args = ["replay", str(tmp_path / "v2.jsonl"), "--policy", "lru", "--expert-budget", "50%"]
    assert main([*args, "--predictor", "trace,last-call", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["predictors"]
    assert (out["trace"]["precision"], out["trace"]["recall"]) == (5 / 6, 5 / 8)
    write_trace(tmp_path / "v1.jsonl", v1)
    args[1] = str(tmp_path / "v1.jsonl")
    assert main([*args, "--predictor", "trace"]) != 0
    assert "record-trace --predictions" in capsys.readouterr().err


def test_check_sources_and_scoped_registration() -> None:
    v2 = TraceRouting(v2_trace(), 16, 4, "v2")
    v1 = TraceRouting(
        RoutingTrace(v2_trace().header, [TraceRecord(0, 0, [0], [[1, 2]])]), 16, 4, "v1"
    )
    check_sources("trace", [v2])
    check_sources("last-call", [None, v1])  # only --prefetch trace needs predictions
    for sources in ([v1], [None], [v2, None]):
        with pytest.raises(ConfigError, match="--routing trace:FILE"):
            check_sources("trace", sources)
    assert "trace" not in PREDICTORS
    with registered("trace"):
        assert PREDICTORS["trace"] is TracePredictor
    with registered("last-call"):
        assert "trace" not in PREDICTORS
    assert "trace" not in PREDICTORS  # the engine's registry outside the bench run


def _ranked_by_hand(rows: list[list[int]]) -> list[int]:
    """The documented order, written out: most rows first, then first appearance."""
    seen: list[int] = []
    for row in rows:
        seen += [e for e in row if e not in seen]
    return sorted(seen, key=lambda e: (-sum(e in row for row in rows), seen.index(e)))


def test_bench_latency_prefetches_exactly_the_recorded_predictions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tiny-qwen3 (2 MoE layers, 16 experts, top-4) replays a 2-layer v2 trace of 32 experts:
    every layer-0 call prefetches, for layer 1, the ranked union of the mapped predicted rows
    of exactly the rows that call replayed; layer 1 (the last) prefetches nothing."""
    rows = [[(3 * t + j) % 32 for j in range(4)] for t in range(5)]
    guesses = [[(5 * t + 2 * j) % 32 for j in range(4)] for t in range(5)]
    header = TraceHeader(2, 32, 4, [0, 1], 0)
    recs = [TraceRecord(0, 0, [0] * 5, rows, guesses), TraceRecord(0, 1, [0] * 5, rows[::-1])]
    path = tmp_path / "v2.jsonl"
    write_trace(path, RoutingTrace(header, recs))
    seen: list[tuple[int, list[int]]] = []
    original = Prefetcher._prefetch

    def spy(self: Prefetcher, layer: int, experts: list[int]) -> None:
        if experts:
            seen.append((layer, list(experts)))
        original(self, layer, experts)

    monkeypatch.setattr(Prefetcher, "_prefetch", spy)
    # 16 of 32 slots: room for guesses beside layer 0's pinned experts and layer 1's own
    args = ["bench", "latency", "--synthetic", "tiny-qwen3", "--expert-budget", "50%"]
    args += ["--input-len", "8", "--output-len", "4", "--no-progress"]
    args += ["--routing", f"trace:{path}", "--prefetch", "trace"]
    out = tmp_path / "r.json"
    assert main([*args, "--save-result", str(out), "--save-trace", str(tmp_path / "t.jsonl")]) == 0
    run = json.loads(out.read_text())["configs"][1]
    assert run["budget"] == "50%" and run["prefetches_issued"] > 0
    # the calls as they ran (warm-up and timed pass of the 50% run): T rows each, in order
    calls = read_trace(tmp_path / "t.jsonl").records
    assert [r.layer for r in calls] == [0, 1] * (len(calls) // 2) and len(calls) == 16
    expected = []
    pos = 0
    for rec in calls[::2]:  # layer 0's calls
        at = [(pos + t) % 5 for t in range(len(rec.experts))]
        pos += len(rec.experts)
        assert [sorted(r) for r in rec.experts] == [sorted(e % 16 for e in rows[i]) for i in at]
        expected.append((1, _ranked_by_hand([[e % 16 for e in guesses[i]] for i in at])))
    # the first call is the warm-up's 8-token prompt: rows 0-4, then 0-2 again
    assert expected[0] == (
        1,
        _ranked_by_hand([[e % 16 for e in guesses[i]] for i in [0, 1, 2, 3, 4, 0, 1, 2]]),
    )
    assert seen == expected
    assert "trace" not in PREDICTORS


def test_bench_latency_prefetch_trace_needs_a_v2_trace_routing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v1 = tmp_path / "v1.jsonl"
    write_trace(
        v1, RoutingTrace(TraceHeader(1, 16, 4, [0], 0), [TraceRecord(0, 0, [0], [[1, 2, 3, 4]])])
    )
    args = ["bench", "latency", "--synthetic", "tiny-qwen3", "--expert-budget", "25%"]
    args += ["--input-len", "8", "--output-len", "2", "--no-progress", "--prefetch", "trace"]
    for routing in ("uniform", f"trace:{v1}", "model"):
        assert main([*args, "--routing", routing]) != 0
        assert "record-trace --predictions" in capsys.readouterr().err
