"""CPU smoke runs of `moetier bench latency`, `bench plot` and `bench gate` on a tiny shape.

No timing assertions: keys present and finite, bound computed, files written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from moetier.cli import main

KEYS = (
    "ttft_ms",
    "tpot_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tokens_per_s",
    "gpu_busy_ms",
    "host_overhead_ms",
    "offload_cost_ms",
    "exposed_fetch_ms_per_token",
    "h2d_bytes_per_token",
    "disk_bytes_per_token",
    "device_hit_rate",
    "belady_hit_rate",
    "bound_tpot_ms",
    "tpot_over_bound",
    "peak_device_bytes",
    "peak_host_rss_bytes",
)
SETTINGS = (
    "shape",
    "dtype",
    "device_type",
    "torch",
    "policy",
    "prefetch",
    "seed",
    "routing_source",
    "input_len",
    "output_len",
    "batch_size",
    "host_budget",
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("lat")
    rc = main(
        [
            "bench",
            "latency",
            "--synthetic",
            "tiny-qwen3",
            "--expert-budget",
            "25%",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--routing",
            "uniform,model",
            "--compare",
            "transformers,accelerate",
            "--no-progress",
            "--save-result",
            str(out / "r.json"),
            "--save-trace",
            str(out / "t.jsonl"),
            "--plot",
            str(out),
        ]
    )
    assert rc == 0
    return json.loads((out / "r.json").read_text()), out


def test_keys_present_and_finite(result: tuple[dict, Path]) -> None:
    res, _ = result
    assert [(c["routing"], c["budget"]) for c in res["configs"]] == [
        ("uniform", "100%"),
        ("uniform", "25%"),
        ("model", "100%"),
        ("model", "25%"),
    ]
    for cfg in res["configs"]:
        for key in KEYS:
            assert isinstance(cfg[key], (int, float)) and math.isfinite(cfg[key]), key
        assert cfg["bound_tpot_ms"] > 0 and cfg["tokens_match_reference"] is True
    # greedy tokens with the model's routers: once per budget (first routing), 25% == 100%
    greedy = [c.get("greedy_tokens") for c in res["configs"]]
    assert len(greedy[0]) == 8 and greedy[1] == greedy[0] and greedy[2:] == [None, None]
    assert [c.get("greedy_match_reference") for c in res["configs"]] == [True, True, None, None]
    for key in SETTINGS:
        assert key in res["settings"], key
    assert res["link"]["GBps_expert"] > 0 and res["link"]["GBps_16MiB"] > 0
    # the KV format asked (auto) and the one in effect (the synthetic run's model dtype)
    assert res["settings"]["kv_cache_dtype"] == "auto"
    assert res["settings"]["kv_cache_format"] == res["configs"][0]["kv_cache_dtype"]
    assert res["configs"][0]["kv_cache_dtype"] in ("bf16", "fp32")
    ref, low = res["configs"][0], res["configs"][1]
    assert ref["belady_hit_rate"] == 1.0 and ref["device_slots"] == 32
    assert low["device_slots"] == 8 and low["belady_hit_rate"] >= low["device_hit_rate"]


def test_baselines_reported(result: tuple[dict, Path]) -> None:
    res, _ = result
    base = {b["name"]: b for b in res["baselines"]}
    assert base["transformers"]["greedy_agree"] is True  # model routers, whatever --routing
    assert "CUDA" in base["accelerate"]["skipped"]


def test_trace_and_plots_written(result: tuple[dict, Path]) -> None:
    from moetier.bench.trace import read_trace

    _, out = result
    trace = read_trace(out / "t.jsonl")
    assert trace.header.num_experts == 16 and trace.header.top_k == 4
    assert all(len(r.experts) == len(r.requests) for r in trace.records)
    assert (out / "r-tpot.png").stat().st_size > 0
    assert main(["bench", "plot", str(out / "r.json"), "--out-dir", str(out / "p")]) == 0
    assert (out / "p" / "r-breakdown.png").stat().st_size > 0


def test_gate_writes_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "bench",
            "gate",
            "--baseline",
            "policy=lru",
            "--candidate",
            "policy=lfu",
            "--shapes",
            "tiny-qwen3",
            "--seeds",
            "0,1",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--no-progress",
            "--out-dir",
            str(tmp_path),
            "--name",
            "t",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert ("verdict: **SHIP**" in text) != ("verdict: **NO-SHIP**" in text)
    md = next(tmp_path.glob("*-gate-t.md")).read_text()
    assert "| tiny-qwen3 | 0 |" in md and "| tiny-qwen3 | 1 |" in md
    record = json.loads(next(tmp_path.glob("*-gate-t.json")).read_text())
    assert record["verdict"] in ("SHIP", "NO-SHIP") and len(record["pairs"]) == 2


def test_latency_on_tiny_deepseek_v4(tmp_path: Path) -> None:
    """DeepSeek-V4's hash-routed layers take the override (their token ids ignored) as the
    top-k layers do; every budget generates the 100% run's tokens under both routings."""
    out = tmp_path / "v4.json"
    args = ["bench", "latency", "--synthetic", "tiny-deepseek-v4", "--device", "cpu"]
    args += ["--expert-budget", "25%", "--input-len", "8", "--output-len", "4"]
    args += ["--routing", "uniform,model", "--num-prompts", "1", "--no-progress"]
    assert main([*args, "--save-result", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["synthetic_meta"]["shape"] == "tiny-deepseek-v4"
    assert [(c["routing"], c["budget"], c["device_slots"]) for c in res["configs"]] == [
        ("uniform", "100%", 64),
        ("uniform", "25%", 16),
        ("model", "100%", 64),
        ("model", "25%", 16),
    ]
    assert all(c["tokens_match_reference"] is True for c in res["configs"])


def test_gpu_memory_run_reports_its_split(tmp_path: Path) -> None:
    """--gpu-memory adds one run after the 100% reference whose expert slots and KV blocks the
    split decided; its JSON and table say how (the split's bytes are the pools' bytes)."""
    from moetier.bench.report import latency_table

    out = tmp_path / "split.json"
    rc = main(
        ["bench", "latency", "--synthetic", "tiny-qwen3", "--gpu-memory", "1100MiB"]
        + ["--kv-cache-dtype", "int8", "--set", "max_model_len=256 max_num_seqs=4"]
        + ["--input-len", "16", "--output-len", "4", "--no-progress", "--save-result", str(out)]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    ref, split = res["configs"]
    assert [ref["budget"], split["budget"]] == ["100%", "gpu-memory 1100MiB"]
    assert ref["split_reason"] == "no_gpu_memory" and ref["gpu_memory_bytes"] == 0
    assert split["gpu_memory_bytes"] == 1100 * 2**20
    assert split["split_reason"] == "kv_request"
    assert split["kv_cache_dtype"] == "int8"
    assert split["split_kv_bytes"] == split["kv_cache_bytes"]
    assert split["split_expert_bytes"] == split["device_slots"] * split["expert_bytes"]
    assert split["split_expert_bytes"] + split["split_kv_bytes"] < split["gpu_memory_bytes"]
    # the KV holds at least the request: 4 sequences of 256 tokens
    assert split["split_kv_bytes"] >= 4 * 256 * split["kv_bytes_per_token"]
    assert split["tokens_match_reference"] is True
    table = latency_table(res)
    assert "memory split, model gpu-memory 1100MiB: 1.07 GiB -> experts" in table
    assert "memory split, model 100%" not in table


def test_gpu_memory_refuses_other_expert_budgets() -> None:
    from moetier.bench.cli import latency_budgets
    from moetier.errors import ConfigError

    assert latency_budgets(None, None) == ["100%", "25%", "10%"]
    assert latency_budgets(None, "20GiB") == ["100%"]
    assert latency_budgets("100%", "20GiB") == ["100%"]
    with pytest.raises(ConfigError, match="leave --expert-budget out"):
        latency_budgets("100%,25%", "20GiB")


def test_gpu_memory_split_below_every_expert_is_bounded_at_its_slots(tmp_path: Path) -> None:
    """A --gpu-memory that leaves room for 12 of the 32 experts beside the KV request: the run
    has 12 slots, its bound counts Belady's misses at 12 slots, and the table labels the row by
    the device budget and the experts' share, with the KV format beside it."""
    from moetier import LLM
    from moetier.bench.report import latency_table
    from moetier.bench.synthetic import ensure_synthetic
    from moetier.config import format_bytes

    # the non-expert weights and the reserve as the split sees them (any fitting budget works)
    llm = LLM(
        str(ensure_synthetic("tiny-qwen3", None, 0)),
        gpu_memory="1100MiB",
        kv_cache_dtype="int8",
        max_model_len=256,
        max_num_seqs=4,
        progress=False,
    )
    split_plan, stats = llm.engine.runner.memory_split, llm.offload_stats()
    del llm
    eb = stats["expert_bytes"]
    request = 4 * 256 * stats["kv_bytes_per_token"]  # max_num_seqs x max_model_len
    gpu = split_plan.weights + split_plan.reserve + request + 12 * eb + eb // 2
    out = tmp_path / "split12.json"
    rc = main(
        ["bench", "latency", "--synthetic", "tiny-qwen3", "--gpu-memory", str(gpu)]
        + ["--kv-cache-dtype", "int8", "--set", "max_model_len=256 max_num_seqs=4"]
        + ["--input-len", "16", "--output-len", "8", "--no-progress", "--save-result", str(out)]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    ref, split = res["configs"]
    assert res["settings"]["gpu_memory"] == str(gpu)
    assert split["gpu_memory_bytes"] == gpu and split["split_reason"] == "kv_request"
    assert (split["device_slots"], split["total_experts"]) == (12, 32)
    assert split["budget_fraction"] == 12 / 32
    assert split["split_expert_bytes"] == 12 * eb == split["budget_bytes"]
    assert split["kv_blocks"] >= 4 * 256 // 16 and split["kv_cache_dtype"] == "int8"
    assert split["split_kv_bytes"] == split["kv_cache_bytes"] >= request
    # the bound at the split's own 12 slots: the reference's busy time plus Belady's misses
    link = res["link"]
    assert split["belady_misses_per_token"] > 0
    per_miss_ms = link["link_bytes_per_miss"] / (link["bound_GBps"] * 1e9) * 1e3
    assert split["bound_tpot_ms"] == pytest.approx(
        ref["gpu_busy_ms"] + split["belady_misses_per_token"] * per_miss_ms
    )
    assert split["bound_tpot_ms"] > ref["bound_tpot_ms"]
    table = latency_table(res)
    assert "| routing | budget | slots | KV | TTFT ms |" in table
    assert "| model | 100% | 32 | int8 |" in table
    assert f"| model | gpu {gpu} (experts 38%) | 12 | int8 |" in table
    assert f"-> experts {format_bytes(12 * eb)} (12 of 32 experts, 37.5%), KV " in table


def test_budget_label() -> None:
    from moetier.bench.report import budget_label

    split = {"budget": "gpu-memory 20GiB", "gpu_memory_bytes": 20 << 30, "budget_fraction": 0.41}
    assert budget_label(split, "20GiB") == "gpu 20GiB (experts 41%)"
    share = {**split, "budget": "gpu-memory 90%", "gpu_memory_bytes": 18 << 30}
    assert budget_label(share, "90%") == "gpu 90% = 18.00 GiB (experts 41%)"
    assert budget_label({"budget": "25%", "gpu_memory_bytes": 0}, None) == "25%"
    assert budget_label({"budget": "25%"}, None) == "25%"  # results from before the split


def test_table_without_gpu_memory_has_no_kv_column(result: tuple[dict, Path]) -> None:
    from moetier.bench.report import latency_table

    table = latency_table(result[0])
    assert "| routing | budget | slots | TTFT ms |" in table and "| KV |" not in table
    assert "| uniform | 25% | 8 |" in table and "memory split" not in table


def test_set_may_not_name_a_budget() -> None:
    from moetier.bench.cli import latency_llm_kwargs
    from moetier.errors import ConfigError

    assert latency_llm_kwargs("max_model_len=256 max_num_seqs=4") == {
        "max_model_len": 256,
        "max_num_seqs": 4,
    }
    with pytest.raises(ConfigError, match="give --gpu-memory 20GiB, not --set gpu_memory=20GiB"):
        latency_llm_kwargs("max_num_seqs=4 gpu_memory=20GiB")
    with pytest.raises(ConfigError, match="give --expert-budget 25%, not --set expert_budget=25%"):
        latency_llm_kwargs("expert_budget=25%")


def test_set_may_name_the_runs_own_flags() -> None:
    """`--set policy=X` is `--policy X` (it used to reach LLM twice: a TypeError); a flag given
    with another value is an error naming both."""
    from moetier.bench.cli import latency_settings
    from moetier.cli import build_parser
    from moetier.errors import ConfigError

    def settings(*argv: str) -> Any:
        return latency_settings(build_parser().parse_args(["bench", "latency", *argv]))

    s = settings("--set", "policy=activation transfer_window=4")
    assert (s.policy, s.llm_kwargs) == ("activation", {"transfer_window": 4})
    s = settings("--policy", "activation", "--set", "policy=activation seed=3 dtype=float32")
    assert (s.policy, s.seed, s.dtype, s.llm_kwargs) == ("activation", 3, "float32", {})
    assert settings("--policy", "layer-lru").policy == "layer-lru"
    with pytest.raises(ConfigError, match="--policy layer-lru and --set policy=lru disagree"):
        settings("--policy", "layer-lru", "--set", "policy=lru")
