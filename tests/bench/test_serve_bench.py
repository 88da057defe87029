"""`moetier bench serve` against a live tiny server on 127.0.0.1, and the ShareGPT parser."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from moetier.bench.serve import offload_delta, parse_metrics, summarize
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
        _check_dedup(off, lv["max_concurrency"])
    assert result["results"][0]["offload"]["distinct_over_sum"] == pytest.approx(1.0)
    assert "distinct experts / decode step" in text and "sum over requests / decode step" in text


# The tiny server model (tests/server/tiny.py): Mixtral, 3 MoE layers, top-2 of 8 experts.
_K, _LAYERS = 2, 3


def _check_dedup(off: dict[str, Any], concurrency: int) -> None:
    """Per-step dedup keys of one level: 4 requests of 12 prompt + 6 output tokens each."""
    assert off["distinct_over_sum_source"] == "measured on decode steps"
    assert off["prefill_steps"] >= 1 and off["decode_steps"] >= 5
    assert off["engine_steps"] == off["decode_steps"] + off["prefill_steps"]
    assert off["moe_layers_per_step"] == _LAYERS
    # every fed token: 12 prompt + 5 decode per request (the 6th output token is never fed)
    assert off["token_lookups"] == 4 * (12 + 5) * _K * _LAYERS
    # a decode batched with another request's prompt chunk makes a prefill (mixed) step
    decode_pairs = off["token_lookups_host_decode"]
    assert 0 < decode_pairs <= 4 * 5 * _K * _LAYERS
    assert off["decode_steps_measured"] == off["decode_steps"]
    per_step = off["sum_over_requests_per_decode_step"]
    assert per_step * off["decode_steps"] == pytest.approx(decode_pairs)
    assert 0 < off["distinct_per_decode_step"] <= off["sum_over_requests_per_decode_step"]
    assert off["distinct_over_sum"] == off["decode_distinct_over_sum"]
    assert 0 < off["prefill_distinct_over_lookups"] <= 1
    if concurrency == 1:  # one request per decode step: its top-k experts are distinct
        assert off["decode_steps"] == 4 * 5 and decode_pairs == 4 * 5 * _K * _LAYERS
        assert off["distinct_per_decode_step"] == off["sum_over_requests_per_decode_step"]
        assert off["distinct_per_decode_step"] == _K * _LAYERS


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


def test_dedup_from_metrics_pages() -> None:
    """Step and per-call counters parse by label and turn into per-decode-step figures."""

    def page(steps: int, calls: int, pairs: int, distinct: int) -> str:
        m = 'model_name="m"'
        return (
            "# TYPE moetier:engine_steps counter\n"
            f'moetier:engine_steps_total{{{m},step="decode"}} {steps}\n'
            f'moetier:engine_steps_total{{{m},step="prefill"}} 1\n'
            "# TYPE moetier:moe_layer_calls counter\n"
            f'moetier:moe_layer_calls_total{{{m},routing="host",step="decode"}} {calls}\n'
            f'moetier:moe_layer_calls_total{{{m},routing="host",step="prefill"}} 2\n'
            f'moetier:moe_layer_calls_total{{{m},routing="device",step="decode"}} 0\n'
            "# TYPE moetier:expert_token_lookups counter\n"
            f'moetier:expert_token_lookups_total{{{m},routing="host",step="decode"}} {pairs}\n'
            f'moetier:expert_token_lookups_total{{{m},routing="host",step="prefill"}} 40\n'
            "# TYPE moetier:expert_distinct_lookups counter\n"
            f'moetier:expert_distinct_lookups_total{{{m},routing="host",step="decode"}} '
            f"{distinct}\n"
            f'moetier:expert_distinct_lookups_total{{{m},routing="host",step="prefill"}} 10\n'
        )

    before = parse_metrics(page(0, 0, 0, 0))
    assert before["moe_calls_host_prefill"] == 2 and before["token_lookups_host_prefill"] == 40
    # 10 decode steps x 2 MoE layers, 4 requests x top-2 per call, 5 distinct per call
    off = offload_delta(before, parse_metrics(page(10, 20, 160, 100)), 40)
    assert off is not None
    assert (off["engine_steps"], off["decode_steps"], off["moe_layers_per_step"]) == (10, 10, 2)
    assert off["distinct_per_decode_step"] == 10 and off["sum_over_requests_per_decode_step"] == 16
    assert off["decode_distinct_over_sum"] == 100 / 160
    assert off["prefill_distinct_over_lookups"] is None  # no prefill step in the delta
    # all resident: decode calls on the device table, distinct not measured (None, not 0)
    resident = page(10, 0, 0, 0).replace(
        'routing="device",step="decode"} 0', 'routing="device",step="decode"} 20'
    )
    off = offload_delta(before, parse_metrics(resident), 40)
    assert off is not None and off["moe_layers_per_step"] == 2
    assert off["distinct_per_decode_step"] is None and off["decode_distinct_over_sum"] is None


def test_random_prompts_without_a_vocabulary_fall_back_to_byte_ids() -> None:
    """A synthetic checkpoint's tokenizer may load with an empty vocabulary: token-id prompts
    still work (the H200 serving sweep runs on one); chat prompts need real text."""
    import pytest

    from moetier.bench.serve_data import sample_random
    from moetier.errors import ConfigError

    class Empty:
        all_special_ids: list[int] = []

        def __len__(self) -> int:
            return 0

    prompts = sample_random(Empty(), 3, 5, 2, seed=0, as_text=False)
    assert [len(p.prompt) for p in prompts] == [5, 5, 5]  # type: ignore[arg-type]
    assert all(0 <= t < 256 for p in prompts for t in p.prompt)  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="need a tokenizer"):
        sample_random(Empty(), 1, 5, 2, seed=0, as_text=True)


# Agent workload on the tiny model: block size 16 (serve's default), first prompt 20 ids,
# answers of 4 tokens, tool results of 24 ids: prompts of 20, 48 and 76 tokens. After turn t its
# computed tokens (prompt + answer - 1: the last answer token is never fed) leave
# floor(/16) full blocks cached, all of which turn t + 1's prompt starts with.
_AGENT_PROMPTS = [20, 48, 76]
_AGENT_HITS = [0, (20 + 4 - 1) // 16 * 16, (48 + 4 - 1) // 16 * 16]  # 0, 16, 48 per conversation


def test_bench_serve_agent_turns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_server_model(tmp_path / "tiny-moe", max_position_embeddings=512)
    out = tmp_path / "agent.json"
    rc = main([
        "bench", "serve", "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--expert-budget", "50%", "--workload", "agent", "--turns", "3", "--input-len", "20",
        "--tool-result-len", "24", "--output-len", "4", "--num-prompts", "2",
        "--temperature", "0", "--compare-prefix-off", "--save-result", str(out),
        "--no-progress", "--server-log", str(tmp_path / "server.log"),
    ])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, (tmp_path / "server.log").read_text()
    assert "| turn |" in text and "fresh TTFT med ms" in text
    result = json.loads(out.read_text())
    s = result["settings"]
    assert (s["workload"], s["turns"], s["tool_result_len"]) == ("agent", 3, 24)
    assert "--enable-prefix-caching" in s["server_command"].split()
    assert s["prefix_caching"] == "on" and s["device_slots"] == 12  # 50% of 3 layers x 8
    turns = result["agent"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert [t["prompt_tokens_median"] for t in turns] == _AGENT_PROMPTS
    assert [t["new_tokens_median"] for t in turns] == [20, 4 + 24, 4 + 24]
    assert [t["prefix_cache_queries"] for t in turns] == [2 * n for n in _AGENT_PROMPTS]
    assert [t["prefix_cache_hits"] for t in turns] == [2 * h for h in _AGENT_HITS]
    assert [t["cached_tokens_mean"] for t in turns] == _AGENT_HITS
    assert turns[1]["prefix_hit_rate"] == pytest.approx(16 / 48)
    for t in turns:
        assert _finite(t["ttft_median_ms"]) and t["bytes_host_to_device_mean"] is not None
        assert t["tokens_match_prefix_off"] is True
        assert _finite(t["prefix_off_ttft_median_ms"])
    assert turns[0]["fresh_ttft_median_ms"] is None  # turn 1 is its own fresh request
    for t in turns[1:]:
        assert _finite(t["fresh_ttft_median_ms"]) and _finite(t["ttft_over_fresh"])
        assert t["fresh_prefix_cache_hits"] == 0
    off = result["agent"]["prefix_off"]["turns"]
    assert [t["prefix_cache_hits"] for t in off] == [0, 0, 0]
    rows = result["agent"]["requests"]
    assert [(r["conversation"], r["turn"]) for r in rows] == [
        (c, t) for c in (0, 1) for t in (1, 2, 3)
    ]
    assert all(len(r["output_ids"]) == 4 for r in rows)
