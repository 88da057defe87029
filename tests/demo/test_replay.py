"""`moetier replay`: policy and Belady hit rates with the engine's slot semantics, exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetier.bench.replay import load_trace, replay, simulate, slots_for_budget
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord
from moetier.cli import main
from moetier.demo.tracing import save_trace
from moetier.errors import MoetierError
from moetier.offload.policy import make_policy


def _trace(calls: list[tuple[int, list[list[int]]]], experts: int, top_k: int) -> RoutingTrace:
    """One record per (layer, per-token ids); each call its own step, request 0."""
    layers = sorted({layer for layer, _ in calls})
    header = TraceHeader(max(layers) + 1, experts, top_k, layers, expert_bytes=100)
    records = [
        TraceRecord(step, layer, [0] * len(rows), rows) for step, (layer, rows) in enumerate(calls)
    ]
    return RoutingTrace(header, records)


# one layer, top-1, 3 slots: LRU 3/10 hits, LFU 4/10 (keeps the thrice-used 0), Belady 5/10
SEQUENCE = [0, 0, 0, 1, 2, 3, 0, 2, 1, 3]


def sequence_trace() -> RoutingTrace:
    return _trace([(0, [[e]]) for e in SEQUENCE], experts=8, top_k=1)


def test_hand_made_trace_hit_rates_exact() -> None:
    trace = sequence_trace()
    assert slots_for_budget(trace.header, "300") == 3
    slots, best, rates = replay(trace, "300", ["lru", "lfu"])
    assert (slots, best, rates) == (3, 0.5, {"lru": 0.3, "lfu": 0.4})


def test_eviction_orders_exact() -> None:
    records = sequence_trace().records
    lru = simulate(records, 3, make_policy("lru"), keep_evictions=True)
    assert lru.evictions == [(0, 0), (0, 1), (0, 3), (0, 0)]
    lfu = simulate(records, 3, make_policy("lfu"), keep_evictions=True)
    assert lfu.evictions == [(0, 1), (0, 3), (0, 1)]


def test_calls_larger_than_the_pool_go_in_waves() -> None:
    # 4 distinct experts, 3 slots: waves [0, 1, 2] then [3]; the next call needs 0 and 3
    trace = _trace([(0, [[0, 1], [2, 3]]), (0, [[3, 0]])], experts=4, top_k=2)
    lru = simulate(trace.records, 3, make_policy("lru"), keep_evictions=True)
    assert (lru.requests, lru.hits, lru.evictions) == (6, 1, [(0, 0), (0, 1)])
    _, best, rates = replay(trace, "75%", ["lru"])
    assert (best, rates) == (pytest.approx(2 / 6), {"lru": pytest.approx(1 / 6)})


def test_full_budget_preloads_everything_and_too_small_a_budget_is_an_error() -> None:
    trace = _trace([(0, [[0, 1]]), (1, [[2, 3]])], experts=4, top_k=2)
    assert replay(trace, "100%", ["lru", "lfu"]) == (8, 1.0, {"lru": 1.0, "lfu": 1.0})
    with pytest.raises(MoetierError, match="top-k = 2"):
        replay(trace, "100", ["lru"])
    with pytest.raises(MoetierError, match="unknown expert-cache policy"):
        replay(trace, "50%", ["nope"])


def test_cli_replay_json_on_a_gzip_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = save_trace(sequence_trace(), tmp_path / "t.jsonl.gz")
    assert load_trace(path).records == sequence_trace().records
    assert (
        main(["replay", str(path), "--policy", "lru,lfu", "--expert-budget", "300", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out) == {
        "belady": 0.5,
        "policies": {"lru": 0.3, "lfu": 0.4},
    }
    assert main(["replay", str(path), "--expert-budget", "300"]) == 0
    text = capsys.readouterr().out
    assert "3 of 8 expert slots" in text and "lfu" in text and "-10.0 pt" in text


def test_cli_streamed_prefill_replay(capsys: pytest.CaptureFixture) -> None:
    """--prompt-len: prompts of 64 tokens (uniform top-2 of 8: every expert touched) through 6
    layers at 50% (3 layers of slots), each call streaming the next layer: LRU reloads every
    expert each prompt; stream_eviction makes Belady's choices under the same streaming."""
    args = ["replay", "uniform:8x2", "--prompt-len", "64", "--layers", "6", "--steps", "4"]
    assert main([*args, "--expert-budget", "50%", "--policy", "lru", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["slots"], out["streamed_calls"], out["calls"]) == (24, 24, 24)
    loads = {name: list(per.values()) for name, per in out["loads"].items()}
    assert loads == {
        "floor: step keys - slots": [48, 24, 24, 24],
        "belady, demand (bound)": [48, 24, 24, 32],
        "belady rule, streamed": [48, 32, 40, 32],
        "lru": [48, 48, 48, 48],
        "lru + stream_eviction": [48, 32, 40, 32],
    }
    assert main([*args[:-1], "3", "--output-len", "2", "--expert-budget", "50%"]) == 0
    text = capsys.readouterr().out
    assert "3 prompts of 64 tokens, 2 decode steps each" in text and "decode" in text
