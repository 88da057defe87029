"""`moetier bench serve` against a live tiny server on 127.0.0.1, and the ShareGPT parser."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from moetier.bench.serve import parse_metrics, summarize
from moetier.bench.serve_data import iter_json_array, parse_sharegpt
from moetier.cli import main
from tests.server.tiny import make_tiny_server_model

_LATENCY_KEYS = [
    f"{stat}_{name}_ms"
    for name in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p99")
]
_LEVEL_KEYS = [
    "max_concurrency",
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *_LATENCY_KEYS,
]
_SETTINGS_KEYS = [
    "model", "served_model_name", "device", "dtype", "torch", "expert_budget", "host_budget",
    "dataset", "input_len", "output_len", "num_prompts", "max_concurrency", "request_rate",
    "seed", "endpoint", "server_command",
]  # fmt: skip


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def test_bench_serve_random_against_started_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_server_model(tmp_path / "tiny-moe")
    out = tmp_path / "r.json"
    rc = main([
        "bench", "serve", "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--expert-budget", "50%", "--dataset", "random", "--input-len", "12",
        "--output-len", "6", "--num-prompts", "4", "--max-concurrency", "1,2",
        "--api-key", "sk-bench-1", "--save-result", str(out), "--no-progress",
        "--server-log", str(tmp_path / "server.log"),
    ])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, (tmp_path / "server.log").read_text()
    assert "| conc |" in text and "TTFT" in text
    result = json.loads(out.read_text())
    s = result["settings"]
    for key in _SETTINGS_KEYS:
        assert key in s, key
    assert s["device"] == "cpu" and s["max_concurrency"] == [1, 2]
    assert "sk-bench-1" not in out.read_text()
    assert [lv["max_concurrency"] for lv in result["results"]] == [1, 2]
    for lv in result["results"]:
        for key in _LEVEL_KEYS:
            assert _finite(lv[key]), (key, lv[key])
        assert lv["failed"] == 0 and lv["completed"] == 4
        assert lv["output_len_mismatch"] == 0
        assert lv["total_output_tokens"] == 4 * 6
        assert all(r["output_tokens"] == 6 and r["prompt_len"] == 12 for r in lv["requests"])
        off = lv["offload"]
        assert off is not None and off["generation_tokens"] == 4 * 6
        assert _finite(off["expert_lookups"]) and off["expert_lookups"] > 0
        assert _finite(off["expert_lookups_per_output_token"])
        assert _finite(off["distinct_over_sum"])
    assert result["results"][0]["offload"]["distinct_over_sum"] == pytest.approx(1.0)


def test_bench_serve_chat_against_running_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.server.conftest import start_server, stop_server

    model = make_tiny_server_model(tmp_path / "tiny-moe")
    server = start_server(model, tmp_path / "server.log", "--api-key", "sk-bench-2")
    try:
        out = tmp_path / "r.json"
        rc = main([
            "bench", "serve", "--base-url", server.url, "--tokenizer", str(model),
            "--api-key", "sk-bench-2", "--endpoint", "chat", "--dataset", "random",
            "--input-len", "8", "--output-len", "5", "--num-prompts", "3",
            "--max-concurrency", "2", "--request-rate", "50", "--save-result", str(out),
            "--no-progress",
        ])  # fmt: skip
        capsys.readouterr()
        assert rc == 0, server.log()
    finally:
        assert stop_server(server) == 0
    (lv,) = json.loads(out.read_text())["results"]
    assert lv["failed"] == 0 and lv["output_len_mismatch"] == 0
    assert lv["total_output_tokens"] == 3 * 5
    assert all(_finite(lv[k]) for k in _LATENCY_KEYS)
    assert lv["offload"]["generation_tokens"] == 3 * 5


def test_sharegpt_parser_tolerates_truncation() -> None:
    text = """[
      {"id": "a", "conversations": [
        {"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4."}]},
      {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},
      {"id": "c", "conversations": [
        {"from": "gpt", "value": "starts with the model"}, {"from": "human", "value": "x"}]},
      {"id": "d", "conversations": [
        {"from": "human", "value": "Name a \\"quoted\\" colour, [please]"},
        {"from": "gpt", "value": "Blue, {obviously}."},
        {"from": "human", "value": "more"}]},
      {"id": "e", "conversations": [
        {"from": "human", "value": "Cut off"}, {"from": "gpt", "value": "Here are the"""
    assert parse_sharegpt(text) == [
        ("What is 2+2?", "4."),
        ('Name a "quoted" colour, [please]', "Blue, {obviously}."),
    ]
    assert list(iter_json_array("[1, 2, 3]")) == [1, 2, 3]
    assert list(iter_json_array("[1, 2, {")) == [1, 2]
    assert list(iter_json_array("[]")) == []


def test_metrics_parse_and_summary() -> None:
    page = (
        '# TYPE moetier:expert_lookups counter\nmoetier:expert_lookups_total{model_name="m"} 7.0\n'
        "# TYPE moetier:expert_hits counter\n"
        'moetier:expert_hits_total{model_name="m",tier="device"} 5.0\n'
        'moetier:expert_hits_total{model_name="m",tier="disk"} 2.0\n'
    )
    assert parse_metrics(page) == {"expert_lookups": 7.0, "device_hits": 5.0, "disk_reads": 2.0}
    assert summarize([], 1.0)["completed"] == 0
