"""Llama 4 specifics beyond the cross-family suite: the router's hand-over to MoEBlock survives
a predictor calling other layers' routers mid-layer and the bench swapping the gates, chunked
prefill keeps the attention chunks, and top-k above 1 is refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetier import LLM
from moetier.errors import UnsupportedModelError
from tests.models.families import FAMILIES
from tests.models.parity import NEW_TOKENS, PROMPTS, check_parity, moetier_greedy
from tests.models.test_prefetch_parity import waves_budget


def test_parity_with_gate_lookahead(tmp_path: Path) -> None:
    # The lookahead calls the next MoE layer's router on this layer's router input (x * score)
    # while this layer's own routing is held: both must stay what HF computes.
    ckpt = FAMILIES["llama4"].checkpoint(tmp_path / "llama4")
    stats = check_parity(ckpt, waves_budget(ckpt), prefetch="gate-lookahead")
    assert stats["prefetches_issued"] > 0 and stats["prefetches_used"] > 0


def test_top_k_above_one_is_refused(tmp_path: Path) -> None:
    ckpt = FAMILIES["llama4"].checkpoint(tmp_path / "llama4", num_experts_per_tok=2)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=2"):
        LLM(str(ckpt), device="cpu", dtype="float32", progress=False)


def test_bench_routing_override_runs_and_undoes(tmp_path: Path) -> None:
    # The bench swaps each block's gate for a wrapper without the score hand-over: the block
    # then weighs outputs as any MoE layer does, and gets its own router back on undo.
    from moetier.bench.routing_override import UniformRouting, install

    ckpt = FAMILIES["llama4"].checkpoint(tmp_path / "llama4")
    llm = LLM(str(ckpt), expert_budget="50%", device="cpu", dtype="float32", progress=False)
    before = moetier_greedy(llm, PROMPTS[:1])
    undo = install(llm.engine.runner.model.moe_blocks(), UniformRouting(8, 1, seed=0))
    assert len(moetier_greedy(llm, PROMPTS[:1])[0]) == NEW_TOKENS
    undo()
    assert moetier_greedy(llm, PROMPTS[:1]) == before


def test_parity_with_chunked_prefill(tmp_path: Path) -> None:
    # Prefill chunks of 5 tokens straddle the attention chunks of 8 (the span's causal mask
    # starts at its cached tokens) while shorter prompts already decode in the same steps.
    ckpt = FAMILIES["llama4"].checkpoint(tmp_path / "llama4")
    check_parity(ckpt, "50%", max_num_batched_tokens=5)
