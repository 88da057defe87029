"""The ship-gate rule on fixed numbers, and k=v settings split between bench and LLM."""

from __future__ import annotations

import pytest

from moetier.bench.cli import parse_kv
from moetier.bench.gate import GateSettings, judge, side_settings
from moetier.errors import ConfigError


def _pair(shape: str, eb: float, ec: float, tb: float, tc: float) -> dict:
    side = lambda e, t: {"exposed_fetch_ms_per_token": e, "tokens_per_s": t}  # noqa: E731
    return {"shape": shape, "seed": 0, "baseline": side(eb, tb), "candidate": side(ec, tc)}


def test_ship_when_fetch_lower_and_speed_kept() -> None:
    assert judge([_pair("a", 2.0, 1.0, 100, 97), _pair("b", 1.0, 1.02, 50, 50)], 0.05) == (
        "SHIP",
        [],
    )


def test_no_ship_reasons() -> None:
    verdict, why = judge([_pair("a", 2.0, 1.0, 100, 90), _pair("b", 1.0, 1.5, 50, 50)], 0.05)
    assert verdict == "NO-SHIP"
    assert why == [
        "a seed 0: tokens/s lower beyond noise",
        "b seed 0: exposed fetch higher beyond noise",
    ]
    assert judge([_pair("a", 1.0, 1.0, 10, 10)], 0.05)[0] == "NO-SHIP"  # not lower: no ship


def test_side_settings_split() -> None:
    kv = parse_kv("policy=lfu expert_budget=10% moe_grouped_kernel=false prefetch=none")
    assert kv == {
        "policy": "lfu",
        "expert_budget": "10%",
        "moe_grouped_kernel": False,
        "prefetch": None,
    }
    s = side_settings(GateSettings({}, kv), kv, "tiny-qwen3", 3)
    assert (s.policy, s.budgets, s.seed, s.synthetic) == ("lfu", ["100%", "10%"], 3, "tiny-qwen3")
    assert s.llm_kwargs == {"moe_grouped_kernel": False, "prefetch": None}


def _prefetch_pair(misses_b: float, misses_c: float, ec: float, issued: int = 5) -> dict:
    pair = _pair("p", 2.0, ec, 100, 100)
    pair["baseline"].update(misses_per_token=misses_b, prefetches_issued=0)
    pair["candidate"].update(misses_per_token=misses_c, prefetches_issued=issued)
    return pair


def test_on_demand_misses_stay_the_fastest_class() -> None:
    # baseline 2.0 ms over 4 misses = 0.5 ms a miss
    assert judge([_prefetch_pair(4.0, 2.0, 1.0)], 0.05) == ("SHIP", [])  # 0.5 ms a miss
    verdict, why = judge([_prefetch_pair(4.0, 2.0, 1.5)], 0.05)  # 0.75 ms a miss: slower
    assert verdict == "NO-SHIP"
    assert why == ["p seed 0: an on-demand miss waits longer beyond noise (0.750 vs 0.500 ms)"]
    # no prefetch on either side: the rule does not apply
    assert judge([_prefetch_pair(4.0, 2.0, 1.5, issued=0)], 0.05) == ("SHIP", [])
    # no misses left: nothing to compare
    assert judge([_prefetch_pair(4.0, 0.0, 1.5)], 0.05) == ("SHIP", [])


def test_prefill_metric_judges_ttft() -> None:
    """--metric prefill: rule 1 on TTFT; tokens/s is still rule 2; decode's exposed fetch no
    longer decides."""

    def pair(shape: str, fb: float, fc: float, tb: float, tc: float) -> dict:
        p = _pair(shape, 1.0, 1.0, tb, tc)  # decode's exposed fetch unchanged
        p["baseline"]["ttft_ms"], p["candidate"]["ttft_ms"] = fb, fc
        return p

    ok = [pair("a", 380.0, 343.0, 44.5, 44.0), pair("b", 340.0, 345.0, 40.0, 40.0)]
    assert judge(ok, 0.05, "prefill") == ("SHIP", [])
    decode_why = "exposed fetch not lower overall (2.000 vs 2.000 ms/token summed)"
    assert judge(ok, 0.05)[1] == [decode_why]
    verdict, why = judge([pair("a", 380.0, 400.0, 44.5, 44.5)], 0.05, "prefill")
    assert verdict == "NO-SHIP"
    assert why == [
        "TTFT not lower overall (400.000 vs 380.000 ms summed)",
        "a seed 0: TTFT higher beyond noise",
    ]
    with pytest.raises(ConfigError, match="gate metric 'ttft'"):
        judge(ok, 0.05, "ttft")
