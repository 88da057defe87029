"""`moetier bench serve --workload contention`: the window arithmetic on hand-made arrival
times, and the workload end to end against a started tiny server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moetier.bench.serve_contention import contention_summary
from moetier.cli import main
from tests.server.tiny import make_tiny_server_model

# The long request is sent at 10.0 s and its first token arrives at 12.0 s (TTFT 2 s).
# a: one token per chunk, decoding through; b: a chunk of 2 tokens at 9.5, then stalled across
# the whole prefill (9.5 -> 13.5); c: finishes during the prefill.
_ARRIVALS = [
    [8.0, 9.0, 10.5, 11.0, 12.0, 12.5],
    [9.0, 9.5, 9.5, 13.5, 14.0],
    [9.0, 11.0],
]


def test_contention_windows_on_hand_made_arrivals() -> None:
    s = contention_summary(_ARRIVALS, 10.0, 2.0, long_prompt_len=64, chunk_tokens=16)
    # tokens by arrival: before < 10.0 <= during <= 12.0 < after
    assert [s[w]["tokens"] for w in ("before", "during", "after")] == [2 + 3 + 1, 3 + 1, 1 + 2]
    # gaps: before a 1.0, b 0.25 x2 (the chunk of 2 after 0.5 s); during a 1.5, 0.5, 1.0, c 2.0;
    # after a 0.5, b 4.0, 0.5
    assert [s[w]["gaps"] for w in ("before", "during", "after")] == [3, 4, 3]
    before, during, after = s["before"], s["during"], s["after"]
    assert before["itl_p50_ms"] == pytest.approx(250.0)
    assert before["itl_p99_ms"] == pytest.approx(250.0 + 0.98 * 750.0)  # numpy linear
    assert before["itl_max_ms"] == pytest.approx(1000.0)
    assert during["itl_p50_ms"] == pytest.approx(1250.0)
    assert during["itl_p99_ms"] == pytest.approx(1500.0 + 0.97 * 500.0)
    assert during["itl_max_ms"] == pytest.approx(2000.0)
    assert after["itl_p50_ms"] == pytest.approx(500.0)
    assert after["itl_p99_ms"] == pytest.approx(500.0 + 0.98 * 3500.0)
    assert after["itl_max_ms"] == pytest.approx(4000.0)
    # b's 4 s gap overlaps the window though no token of b arrived in it
    assert s["max_gap_during_ms"] == pytest.approx(4000.0)
    assert (s["chunk_tokens"], s["chunks"], s["long_prompt_tokens"]) == (16, 4, 64)
    assert s["long_ttft_ms"] == pytest.approx(2000.0)
    assert s["chunk_estimate_ms"] == pytest.approx(500.0)
    assert s["stall_over_chunk"] == pytest.approx(8.0)
    assert s["decoders_decoding_through"] == 2  # c ended at 11.0, before the first token


def test_contention_chunks_round_up_and_empty_windows() -> None:
    s = contention_summary([[1.0, 2.0]], 5.0, 1.0, long_prompt_len=65, chunk_tokens=16)
    assert s["chunks"] == 5 and s["chunk_estimate_ms"] == pytest.approx(200.0)
    assert s["during"] == {
        "tokens": 0, "gaps": 0, "itl_p50_ms": None, "itl_p99_ms": None, "itl_max_ms": None
    }  # fmt: skip
    assert s["max_gap_during_ms"] is None and s["stall_over_chunk"] is None
    assert s["decoders_decoding_through"] == 0


def test_bench_serve_contention_against_started_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_server_model(tmp_path / "tiny-moe")
    out = tmp_path / "contention.json"
    rc = main([
        "bench", "serve", "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--workload", "contention", "--decoders", "2", "--input-len", "8", "--output-len",
        "24", "--contention-after", "4", "--long-len", "64",
        "--serve-args", "--max-num-batched-tokens 16", "--save-result", str(out),
        "--no-progress", "--server-log", str(tmp_path / "server.log"),
    ])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, (tmp_path / "server.log").read_text()
    assert "| window |" in text and "stall / chunk" in text
    result = json.loads(out.read_text())
    s = result["settings"]
    assert (s["workload"], s["decoders"], s["long_len"]) == ("contention", 2, 64)
    assert (s["chunk_tokens"], s["chunk_tokens_source"]) == (16, "--serve-args")
    assert "--max-num-batched-tokens" in s["server_command"].split()
    c = result["contention"]
    summary = c["summary"]
    assert summary["chunks"] == math.ceil(64 / 16) == 4
    assert summary["long_prompt_tokens"] == 64 and c["long"]["output_tokens"] == 4
    assert [d["output_tokens"] for d in c["decoders"]] == [24, 24]
    assert [len(a) for a in c["arrivals_ms"]] == [24, 24]
    windows = [summary[w] for w in ("before", "during", "after")]
    assert sum(w["tokens"] for w in windows) == 2 * 24
    assert sum(w["gaps"] for w in windows) == 2 * 23
    # every decoder had streamed its 4 tokens when the long request was sent (t = 0 ms)
    assert all(sum(t < 0 for t in a) >= 4 for a in c["arrivals_ms"])
    assert summary["before"]["tokens"] >= 2 * 4
    ttft = summary["long_ttft_ms"]
    assert ttft > 0 and summary["chunk_estimate_ms"] == pytest.approx(ttft / 4)
    gap = summary["max_gap_during_ms"]
    if gap is not None:
        assert summary["stall_over_chunk"] == pytest.approx(gap / (ttft / 4))


def test_bench_serve_contention_needs_decoders_past_the_trigger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_server_model(tmp_path / "tiny-moe")
    rc = main([
        "bench", "serve", "--model", str(model), "--workload", "contention",
        "--output-len", "8", "--contention-after", "8", "--no-progress",
    ])  # fmt: skip
    assert rc != 0  # refused before any server starts
    assert "--output-len 8 must exceed --contention-after 8" in capsys.readouterr().err
