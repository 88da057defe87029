"""summarize_routing and format_routing_report on hand-made traces (no model needed)."""

from __future__ import annotations

import pytest

from moetier.bench.routing import RoutingSummary, format_routing_report, summarize_routing

# 2 prompts x 2 layers, 4 experts, top-2
TRACE = [
    [  # prompt 0: 3 tokens
        [(0, 1), (1, 0), (2, 3)],  # layer 0: pairs share 2, 0
        [(0, 1), (0, 2), (0, 2)],  # layer 1: pairs share 1, 2
    ],
    [  # prompt 1: 2 tokens (no pair across prompts)
        [(3, 2), (2, 1)],  # layer 0: pair shares 1
        [(1, 3), (0, 2)],  # layer 1: pair shares 0
    ],
]


def test_reuse_is_mean_overlap_over_consecutive_pairs() -> None:
    s = summarize_routing(TRACE, num_experts=4, top_k=2)
    # layer 0: (2 + 0 + 1) / (3 pairs * 2); layer 1: (1 + 2 + 0) / 6
    assert s.reuse == [pytest.approx(0.5), pytest.approx(0.5)]
    assert s.random_reuse == 0.5
    assert s.mean_reuse == pytest.approx(0.5)
    assert s.reuse_vs_random == pytest.approx(1.0)
    assert (s.prompts, s.tokens) == (2, 5)


def test_popularity_counts_every_pick() -> None:
    s = summarize_routing(TRACE, num_experts=4, top_k=2)
    assert s.popularity == [[2, 3, 3, 2], [4, 2, 3, 1]]
    assert all(sum(c) == 5 * 2 for c in s.popularity)


def test_perfect_and_disjoint_reuse() -> None:
    sticky = [[[(5, 6)] * 4]]
    assert summarize_routing(sticky, 8, 2).reuse == [1.0]
    hopping = [[[(0, 1), (2, 3), (0, 1), (2, 3)]]]
    s = summarize_routing(hopping, 8, 2)
    assert s.reuse == [0.0]
    assert s.random_reuse == 0.25
    assert s.popularity == [[2, 2, 2, 2, 0, 0, 0, 0]]


def test_top1_and_single_token_prompts() -> None:
    s = summarize_routing([[[(1,), (1,), (2,)]], [[(0,)]]], num_experts=4, top_k=1)
    assert s.reuse == [pytest.approx(0.5)]  # the one-token prompt adds no pair
    assert s.popularity == [[1, 2, 1, 0]]


def test_bad_traces_are_rejected() -> None:
    with pytest.raises(ValueError):
        summarize_routing([], 4, 2)
    with pytest.raises(ValueError):
        summarize_routing([[[(0, 1)]], [[(0, 1)], [(0, 1)]]], 4, 2)


def test_report_lists_every_layer_and_the_mean() -> None:
    summary = RoutingSummary(
        num_experts=4,
        top_k=2,
        prompts=2,
        tokens=5,
        reuse=[0.75, 0.25],
        random_reuse=0.5,
        popularity=[[1, 3, 3, 3], [6, 2, 2, 0]],
    )
    lines = format_routing_report(summary).splitlines()
    assert "4 experts, top-2" in lines[0] and "0.500" in lines[0]
    assert lines[2].split()[:3] == ["0", "0.750", "1.50x"]
    assert "#1 30.0%" in lines[2] and "#0 10.0%" in lines[2]
    assert lines[3].split()[-1] == "1"  # layer 1 leaves expert 3 unused
    assert lines[-1].split() == ["mean", "0.500", "1.00x"]
