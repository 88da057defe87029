"""Next-layer predictors: exact predictions on hand-made routing, and their scores in replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetier.bench.replay import predictions, replay_predictors, score_predictions, simulate
from moetier.bench.trace import RoutingTrace, TraceHeader, TraceRecord
from moetier.cli import main
from moetier.demo.tracing import save_trace
from moetier.errors import ConfigError
from moetier.offload.policy import make_policy
from moetier.offload.predict import PREDICTORS, GateLookaheadPredictor, make_predictor


def test_same_index_predicts_this_layers_ids_most_tokens_first() -> None:
    p = make_predictor("same-index", moe_layers=[0, 1, 2])
    assert p.predict(0) == []  # nothing seen
    p.observe(0, [3, 1, 3, 2])  # tokens (3, 1), (3, 2): 3 twice, then 1 and 2 in order seen
    assert p.predict(0) == [3, 1, 2]
    assert p.predict(0, limit=1) == [3]
    assert p.predict(0, ahead=2) == [3, 1, 2]  # for layer 2: still layer 0's ids
    assert [p.target_layer(la) for la in (0, 1, 2)] == [1, 2, 0]  # the last wraps to a new step
    assert p.target_layer(2, ahead=2) == 1 and p.target_layer(5) is None
    p.reset()
    assert p.predict(0) == []


def test_last_call_predicts_the_target_layers_previous_call() -> None:
    p = make_predictor("last-call")  # MoE layers learned from the calls
    p.observe(0, [1, 2])
    assert p.predict(0) == [1, 2]  # the only MoE layer known: its next call is its own
    p.observe(1, [5, 6, 5, 7])
    p.observe(0, [2, 3])
    assert p.predict(0) == [5, 6]  # layer 1's last call, cut to this call's width (2)
    assert p.predict(0, limit=5) == [5, 6, 7]
    assert p.predict(1) == [2, 3]  # wraps: layer 0's last call


def test_activation_predictor_blends_own_matrix_with_the_library() -> None:
    p = make_predictor("activation", moe_layers=[0, 1])
    for _ in range(4):  # request 0: layer 0 -> expert 0, layer 1 -> expert 1
        p.observe(0, [0], [0])
        p.observe(1, [1], [0])
    for _ in range(4):  # request 1 (request 0 missing from the step: retired to the library)
        p.observe(0, [2], [1])
        p.observe(1, [3], [1])
    p.observe(0, [2], [2])  # request 2 starts like request 1 (request 1 retired)
    assert p.tracker.library_size == 2
    # Its matrix (0,2)=1 is cosine 0.707 to request 1's, 0 to request 0's; at layer 1 it has
    # shown no token (own weight t/(t+8) = 0): the prediction is request 1's layer 1.
    assert p.predict(0) == [3]
    p.observe(1, [1], [2])  # now (0,2)=1, (1,1)=1: cosine 0.5 to both library entries
    # For layer 0 (next step): own weight 1/9 on expert 2, library 8/9 x (0.5 e0 + 0.5 e2):
    # expert 2 0.556, expert 0 0.444.
    assert p.tracker.need(0, [2]).tolist() == pytest.approx([4 / 9, 0.0, 5 / 9, 0.0])
    assert p.predict(1) == [2] and p.predict(1, limit=3) == [2, 0]


def test_with_ends_reported_a_missing_request_keeps_its_matrix() -> None:
    p = make_predictor("activation", moe_layers=[0, 1])
    p.ends_reported()
    for _ in range(4):  # request 0 alone
        p.observe(0, [0], [0])
        p.observe(1, [1], [0])
    for _ in range(2):  # request 1 alone: request 0 waits (preempted), it has not ended
        p.observe(0, [2], [1])
        p.observe(1, [3], [1])
    assert p.tracker.library_size == 0 and sorted(p.tracker.active) == [0, 1]
    p.observe(0, [0], [0])  # request 0 resumes with its 4 tokens of history
    assert p.predict(0) == [1]  # its own layer-1 expert, from before the wait
    p.end_request(0)
    assert p.tracker.library_size == 1 and p.tracker.active == [1]
    p.reset()  # the setting survives a reset
    p.observe(0, [0], [5])
    p.observe(0, [0], [6])
    assert sorted(p.tracker.active) == [5, 6] and p.tracker.library_size == 0


def test_gate_lookahead_applies_the_target_layers_router_to_this_hidden_state() -> None:
    w1 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.5, 0.5]])  # 4 experts, D=2

    def router1(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(h @ w1.T, 2, dim=-1)[::-1]  # (ids, weights) like the family routers

    p = GateLookaheadPredictor({0: lambda h: torch.topk(-h, 1).indices, 1: router1})
    hidden = torch.tensor([[2.0, 1.0], [0.0, 3.0]])  # scores [2, 1, -2, 1.5], [0, 3, 0, 1.5]
    p.observe(0, [0, 1])
    # top-2 per token: [0, 3] and [1, 3]: expert 3 twice, then 0 and 1 in order seen
    assert p.predict(0, hidden=hidden, limit=4) == [3, 0, 1]
    assert p.predict(0, hidden=hidden) == [3, 0]  # this call's width: 2
    assert p.predict(0) == []  # no hidden state, no guess
    assert p.needs_hidden and not make_predictor("activation").needs_hidden


def test_registry_names_and_unknown_predictor() -> None:
    assert sorted(PREDICTORS) == ["activation", "gate-lookahead", "hash", "last-call", "same-index"]
    with pytest.raises(ConfigError, match="activation, gate-lookahead, hash, last-call, same-"):
        make_predictor("oracle")


# 2 MoE layers, top-2, request 0; the worked example of the scores below
CALLS = [(0, [0, 1]), (1, [2, 3]), (0, [0, 2]), (1, [2, 1]), (0, [1, 0]), (1, [3, 2])]


def calls_trace() -> RoutingTrace:
    header = TraceHeader(2, 4, 2, [0, 1], expert_bytes=100)
    return RoutingTrace(
        header, [TraceRecord(i // 2, layer, [0], [ids]) for i, (layer, ids) in enumerate(CALLS)]
    )


def test_precision_and_recall_worked_by_hand() -> None:
    trace = calls_trace()
    # last-call, after call i, for the other layer (width 2) vs call i+1's experts:
    #   i0 -> L1: nothing yet, vs {2,3}: 0 of 0 predicted, 2 actual
    #   i1 -> L0: [0,1] vs {0,2}: 1      i2 -> L1: [2,3] vs {1,2}: 1
    #   i3 -> L0: [0,2] vs {0,1}: 1      i4 -> L1: [2,1] vs {2,3}: 1      i5: no next call
    # predicted 8, actual 10, correct 4: precision 0.5, recall 0.4
    last = score_predictions(trace.records, predictions(trace, "last-call"))
    assert (last.predicted, last.actual, last.correct) == (8, 10, 4)
    assert (last.precision, last.recall) == (0.5, 0.4)
    assert last.by_layer == {0: (4, 4, 2), 1: (4, 6, 2)}
    # same-index (this call's ids): i0 [0,1] vs {2,3}: 0; i1 [2,3] vs {0,2}: 1; i2 [0,2] vs
    # {1,2}: 1; i3 [2,1] vs {0,1}: 1; i4 [1,0] vs {2,3}: 0 -> 3 of 10 predicted, 10 actual
    same = score_predictions(trace.records, predictions(trace, "same-index"))
    assert (same.predicted, same.actual, same.correct) == (10, 10, 3)
    with pytest.raises(ConfigError, match="needs hidden states"):
        predictions(trace, "gate-lookahead")
    with pytest.raises(ConfigError, match="reads the step's token ids"):
        predictions(trace, "hash")


def test_prefetch_simulation_exact() -> None:
    # top-1, two layers, 2 slots, LRU; prefetch after calls 0, 2 and 4 (for layer 1)
    calls = [(0, 0), (1, 0), (0, 1), (1, 0), (0, 1), (1, 1)]
    records = [TraceRecord(i // 2, la, [0], [[e]]) for i, (la, e) in enumerate(calls)]
    ahead = [(1, [0]), None, (1, [0]), None, (1, [1]), None]
    # i0 miss, prefetch (1,0); i1 hit; i2 miss evicts (0,0), (1,0) already there; i3 hit;
    # i4 hit, prefetch (1,1) evicts (1,0) (LRU: (0,1) was used after it); i5 hit
    got = simulate(records, 2, make_policy("lru"), keep_evictions=True, prefetch=ahead)
    assert (got.requests, got.hits, got.prefetches, got.prefetch_used) == (6, 4, 2, 2)
    assert got.evictions == [(0, 0), (1, 0)]
    assert got.loads_per_lookup == 4 / 6
    # demand only: misses at i0, i1, i2 (evicts (0,0)) and i5 (evicts (1,0)): same 4 loads
    alone = simulate(records, 2, make_policy("lru"))
    assert (alone.hits, alone.loads_per_lookup) == (2, 4 / 6)


def test_cli_replay_predictors_json_keeps_the_old_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = save_trace(calls_trace(), tmp_path / "t.jsonl.gz")
    args = ["replay", str(path), "--policy", "lru", "--expert-budget", "50%", "--json"]
    assert main(args) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"belady", "policies"}
    assert main([*args, "--predictor", "last-call,same-index"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"belady", "policies", "predictors"}
    last = out["predictors"]["last-call"]
    assert (last["precision"], last["recall"]) == (0.5, 0.4)
    assert last["by_layer"] == {
        "0": {"precision": 0.5, "recall": 0.5},
        "1": {"precision": 0.5, "recall": 2 / 6},
    }
    reports = replay_predictors(calls_trace(), "50%", ["last-call"], ["lru"])
    assert last["prefetch"]["lru"]["hit_rate"] == reports["last-call"].prefetch["lru"].hit_rate
    assert main(args[:-1] + ["--predictor", "last-call"]) == 0
    text = capsys.readouterr().out
    assert "last-call" in text and "precision" in text and "loads/lookup" in text
