"""Expert parallelism on the CPU (gloo): every family with 2 ranks, and three families with 3
(expert counts not divisible by the ranks), equal transformers token for token and in logits,
through `LLM.generate`, at 100%, 50% and each rank's minimum budget; each rank holds exactly
its placement's experts; a bad setting is an error at start-up and a rank that exits names
itself. Each case starts real rank processes (tests/parallel/ is the only place that does)."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from moetier import LLM, SamplingParams
from moetier.errors import ConfigError
from moetier.parallel.placement import Placement
from tests.models.families import FAMILIES
from tests.models.parity import (
    PROMPTS,
    hf_greedy,
    hf_last_logits,
    hf_model,
    moetier_greedy,
    text_config,
    top_k,
)

BUDGETS = [None, "50%", "min"]
# every family at 2 ranks, the budgets in turn; three families at 3 ranks, one per budget
CASES = [(f, 2, BUDGETS[i % 3]) for i, f in enumerate(sorted(FAMILIES))] + [
    ("deepseek_v2", 3, None),
    ("qwen3_moe", 3, "50%"),
    ("gpt_oss", 3, "min"),
]


def _num_experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"])


def rank_min_budget(path: Path, ranks: int) -> str:
    """The smallest budget a rank accepts: top-k slots, or its most experts of one layer when
    fewer (round-robin: ceil(E / N)), in float32 bytes."""
    cfg = text_config(path)
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    slots = min(top_k(cfg), math.ceil(_num_experts(cfg) / ranks))
    return f"{slots * 3 * cfg['hidden_size'] * inter * 4}B"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep")
    return {f: FAMILIES[f].checkpoint(root / f) for f in sorted({c[0] for c in CASES})}


@pytest.mark.parametrize(("family", "ranks", "budget"), CASES, ids=lambda v: str(v))
def test_expert_parallel_equals_transformers(
    family: str, ranks: int, budget: str | None, checkpoints: dict[str, Path]
) -> None:
    check_ranks(checkpoints[family], family, ranks, budget)


# the grouped kernel's terms (its PyTorch reference on the CPU): every owned expert resident
# (the rank's device table, no host sync), waves, the minimum; a top-k-sum family with biases
KERNEL_CASES = [("qwen3_moe", 2, None), ("gpt_oss", 2, "50%"), ("deepseek_v2", 3, "min")]


@pytest.mark.parametrize(("family", "ranks", "budget"), KERNEL_CASES, ids=lambda v: str(v))
def test_expert_parallel_grouped_kernel_equals_transformers(
    family: str,
    ranks: int,
    budget: str | None,
    checkpoints: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import moetier.layers.moe as moe

    calls: list[int] = []
    real = moe.grouped_ffn_terms

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(moe, "grouped_ffn_terms", counting)  # rank 0's calls
    stats = check_ranks(checkpoints[family], family, ranks, budget, moe_grouped_kernel=True)
    assert calls
    if budget is None:  # every call from the rank's device table: no routing to the host
        assert all(r["resident_lookups"] > 0 == r["requests"] for r in stats["ranks"])


def check_ranks(
    path: Path, family: str, ranks: int, budget: str | None, **llm_kwargs: Any
) -> dict[str, Any]:
    """LLM with `ranks` ranks == transformers (greedy tokens of every prompt, one prompt's
    logits); each rank owns its round-robin experts; the LLM is closed after. Its stats."""
    ref = hf_model(path)
    llm = LLM(
        str(path),
        expert_budget=rank_min_budget(path, ranks) if budget == "min" else budget,
        device="cpu",
        dtype="float32",
        progress=False,
        expert_parallel_size=ranks,
        **llm_kwargs,
    )
    try:
        got = moetier_greedy(llm, PROMPTS)
        for prompt, tokens in zip(PROMPTS, got):
            assert tokens == hf_greedy(ref, prompt), f"token mismatch for prompt {prompt}"
        torch.testing.assert_close(
            llm.prompt_logits(PROMPTS[0]), hf_last_logits(ref, PROMPTS[0]), rtol=1e-4, atol=1e-4
        )
        stats = llm.offload_stats()
    finally:
        llm.close()
    cfg = text_config(path)
    layers = llm.engine.runner.expert_cache.host.layout.layers
    owned = Placement.round_robin(layers, _num_experts(cfg), ranks).counts()
    assert [r["rank"] for r in stats["ranks"]] == list(range(ranks))
    assert [r["owned_experts"] for r in stats["ranks"]] == owned
    assert sum(owned) == FAMILIES[family].routed_experts
    assert stats["expert_parallel_size"] == ranks
    # one exchange per MoE layer call, the same on every rank
    calls = {r["collective_calls"] for r in stats["ranks"]}
    assert len(calls) == 1 and calls.pop() > 0
    if budget is None:
        assert all(r["evictions"] == 0 and r["disk_reads"] == 0 for r in stats["ranks"])
        assert [r["device_slots"] for r in stats["ranks"]] == owned
    else:
        assert any(r["evictions"] > 0 for r in stats["ranks"]), stats["ranks"]
    with pytest.raises(
        RuntimeError, match="ExpertParallelError: the expert-parallel group was closed"
    ):
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2))
    return stats


def test_more_ranks_than_experts_is_an_error(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen3_moe"]  # 8 experts a layer
    with pytest.raises(ConfigError, match="more ranks than the model has experts in a layer"):
        LLM(str(path), device="cpu", dtype="float32", progress=False, expert_parallel_size=9)


def test_device_cache_is_refused(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="cannot be combined with --device-cache"):
        LLM(str(checkpoints["qwen3_moe"]), device="cpu", dtype="float32", progress=False,
            expert_parallel_size=2, expert_budget="50%", host_budget="100%",
            device_cache=True)  # fmt: skip


def test_a_rank_that_exits_fails_the_step_and_is_named(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["qwen3_moe"]), device="cpu", dtype="float32", progress=False,
              expert_parallel_size=2, parallel_timeout_s=30)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids) == 4
        worker = llm._workers
        assert worker is not None
        os.kill(worker.procs[0].pid, signal.SIGKILL)
        worker.procs[0].wait(10)
        with pytest.raises(RuntimeError, match="generation failed: .*ExpertParallelError"):
            llm.generate([PROMPTS[1]], params)
        why = llm.parallel_failure()
        assert why is not None and why.startswith("rank 1 exited with code -9")
        with pytest.raises(RuntimeError, match="expert-parallel group of 2 ranks failed"):
            llm.generate([PROMPTS[2]], params)  # every later step fails at once
    finally:
        llm.close()


def test_bench_latency_reports_each_rank(tmp_path: Path) -> None:
    """`bench latency --expert-parallel-size 2`: per-rank rows over the timed pass, each with
    its experts, slots, counters and Belady misses on its own experts; the bound takes the
    slowest rank's."""
    import json

    from moetier.cli import main

    out = tmp_path / "r.json"
    args = ["bench", "latency", "--synthetic", "tiny-qwen3", "--expert-budget", "25%",
            "--input-len", "8", "--output-len", "4", "--routing", "model", "--compare", "",
            "--no-progress", "--expert-parallel-size", "2"]  # fmt: skip
    rc = main([*args, "--save-result", str(out)])
    assert rc == 0
    configs = json.loads(out.read_text())["configs"]
    assert [c["budget"] for c in configs] == ["100%", "25%"]
    for c in configs:
        ranks = c["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        # rank 0's plan is the config's; an even expert count splits evenly
        assert ranks[0]["owned_experts"] == ranks[1]["owned_experts"] == c["total_experts"]
        assert all(r["collective_calls"] > 0 and r["decode_steps"] > 0 for r in ranks)
        worst = max(r["belady_misses_per_token"] for r in ranks)
        assert c["belady_misses_per_token"] == worst
    assert all(r["disk_reads"] == 0 for r in configs[0]["ranks"])  # 100%: each rank holds its own
    assert any(r["device_hits"] < r["requests"] for r in configs[1]["ranks"])
