"""Mixtral parity with transformers at every expert budget, per-expert and fused layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.parity import check_parity, fuse_experts, make_checkpoint, min_budget

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=256,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral", **TINY)


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("mixtral_fused"), "mixtral", seed=1, **TINY)
    fuse_experts(path)
    return path


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_parity_budgets(ckpt: Path, budget: str | None) -> None:
    stats = check_parity(ckpt, min_budget(ckpt) if budget == "min" else budget)
    if budget is None:
        assert stats["disk_reads"] == 0 and stats["evictions"] == 0
    else:
        assert stats["disk_reads"] > 0 and stats["evictions"] > 0


def test_parity_host_tier_below_routed_bytes(ckpt: Path) -> None:
    stats = check_parity(ckpt, "25%", host_budget="50%")
    assert stats["host_rows"] == 12 and stats["disk_reads"] > 0 and stats["host_hits"] > 0


@pytest.mark.parametrize("budget", [None, "min"])
def test_parity_fused_layout(fused_ckpt: Path, budget: str | None) -> None:
    check_parity(fused_ckpt, min_budget(fused_ckpt) if budget == "min" else budget)


def test_batch_of_different_lengths_equals_each_alone(ckpt: Path) -> None:
    from moetier import LLM
    from tests.models.parity import PROMPTS, moetier_greedy

    llm = LLM(str(ckpt), expert_budget="50%", device="cpu", dtype="float32", progress=False)
    together = moetier_greedy(llm, PROMPTS)
    alone = [moetier_greedy(llm, [p])[0] for p in PROMPTS]
    assert together == alone


def test_chunked_prefill_equals_whole_prefill(ckpt: Path) -> None:
    from moetier import LLM
    from tests.models.parity import PROMPTS, moetier_greedy

    whole = LLM(str(ckpt), device="cpu", dtype="float32", progress=False)
    chunked = LLM(
        str(ckpt),
        expert_budget="25%",
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=4,
        progress=False,
    )
    assert moetier_greedy(chunked, PROMPTS) == moetier_greedy(whole, PROMPTS)
