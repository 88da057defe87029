"""`moetier bench kv-formats`: the token comparison, and a run over a tiny random checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier.bench.kv_formats import (
    KVFormatsSettings,
    compare_tokens,
    first_divergence,
    kv_formats_table,
    run_kv_formats,
)
from moetier.errors import ConfigError
from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS
from tests.unit.test_kv_int8 import _TINY_BYTES


def test_compare_tokens_by_hand() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 1]]
    assert [first_divergence(r, g) for r, g in zip(ref, got)] == [4, 1, 0]
    out = compare_tokens(ref, got)
    # identical positions: 4 + 3 + 2 = 9 of 12 (a later token can agree again after a split)
    assert out["identical_tokens"] == 9 and out["total_tokens"] == 12
    assert out["identical_share"] == 0.75
    assert out["first_divergence"] == [4, 1, 0]
    assert out["first_divergence_mean"] == 5 / 3 and out["first_divergence_min"] == 0
    assert out["prompts_identical"] == 1
    with pytest.raises(ValueError, match="differ in length: 2 vs 1"):
        first_divergence([1, 2], [1])
    with pytest.raises(ValueError, match="same non-zero prompt count, got 1, 0"):
        compare_tokens([[1]], [])


def test_kv_formats_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    """float32 model: auto is fp32, so the fp32 format must agree token for token; int8 and
    fp8 report their stored bytes (scales included); the reference compares to itself."""
    path = FAMILIES["qwen3_moe"].checkpoint(tmp_path / "qwen3_moe")
    settings = KVFormatsSettings(
        model=str(path),
        formats=["auto", "fp32", "int8", "fp8"],
        max_tokens=12,
        num_prompts=2,
        dtype="float32",
        llm_kwargs={"num_kv_blocks": 16},
    )
    lines: list[str] = []
    result = run_kv_formats(settings, prompts=[list(p) for p in PROMPTS], report=lines.append)
    assert [line.split(" generated")[0] for line in lines] == [
        "kv-formats: auto (fp32)", "kv-formats: fp32 (fp32)", "kv-formats: int8 (int8)",
        "kv-formats: fp8 (fp8)",
    ]  # fmt: skip
    s = result["settings"]
    assert s["num_prompts"] == 2 and s["prompt_tokens"] == [len(p) for p in PROMPTS[:2]]
    assert s["model"] == str(path)
    runs = {r["kv_cache_dtype"]: r for r in result["formats"]}
    assert list(runs) == ["auto", "fp32", "int8", "fp8"]
    assert {n: r["effective_format"] for n, r in runs.items()} == {
        "auto": "fp32", "fp32": "fp32", "int8": "int8", "fp8": "fp8"
    }  # fmt: skip
    bytes_ = _TINY_BYTES["qwen3_moe"]
    assert {n: r["kv_bytes_per_token"] for n, r in runs.items()} == {
        "auto": bytes_["fp32"], "fp32": bytes_["fp32"], "int8": bytes_["int8"],
        "fp8": bytes_["int8"],
    }  # fmt: skip
    for name in ("auto", "fp32"):
        assert runs[name]["tokens"] == runs["auto"]["tokens"]
        assert runs[name]["identical_share"] == 1.0
        assert runs[name]["first_divergence"] == [12, 12]
    for r in runs.values():
        assert [len(t) for t in r["tokens"]] == [12, 12]
        want = compare_tokens(runs["auto"]["tokens"], r["tokens"])
        assert {k: r[k] for k in want} == want
    table = kv_formats_table(result)
    assert "| fp8 | fp8 | 432 |" in table and "| auto | fp32 | 1,536 | 100.0% (24/24) |" in table


def test_kv_formats_refuses_unknown_names() -> None:
    with pytest.raises(ConfigError, match="unknown KV cache dtype 'fp4'"):
        run_kv_formats(KVFormatsSettings(model="unused", formats=["auto", "fp4"]))


def test_kv_formats_flags() -> None:
    from moetier.bench.cli import kv_formats_settings
    from moetier.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "kv-formats", "--formats", "auto,fp8", "--num-prompts", "3",
         "--max-tokens", "64", "--set", "num_kv_blocks=8"]
    )  # fmt: skip
    s = kv_formats_settings(args)
    assert (s.formats, s.reference, s.num_prompts, s.max_tokens) == (["auto", "fp8"], "auto", 3, 64)
    assert s.model is None and s.llm_kwargs == {"num_kv_blocks": 8}
    default = kv_formats_settings(build_parser().parse_args(["bench", "kv-formats"]))
    assert default.formats == ["auto", "bf16", "int8", "fp8"] and default.max_tokens == 128
