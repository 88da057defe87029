"""Layer streaming (MoEBlock.stream_share): a layer call touching most of its layer's experts
prefetches every expert of the next MoE layer. Forced on the CPU here (on CUDA it is the
default with experts offloaded): greedy tokens still equal transformers, every streamed call is
counted, and calls below the share stream nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moetier import LLM
from tests.models.families import FAMILIES
from tests.models.parity import PROMPTS, check_parity, hf_greedy, hf_model, moetier_greedy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES["qwen3_moe"].checkpoint(tmp_path_factory.mktemp("qwen3_moe"), seed=4)


def test_streaming_keeps_parity_and_counts(ckpt: Path) -> None:
    on = check_parity(ckpt, "75%", moe_stream_share=0.5, late_reads=False)
    assert on["streamed_calls"] > 0 and on["prefetches_streamed"] > 0
    assert on["prefetches_issued"] >= on["prefetches_streamed"]
    off = check_parity(ckpt, "75%", moe_stream_share=0.0, late_reads=False)
    assert off["streamed_calls"] == 0 == off["prefetches_streamed"]


def test_only_wide_calls_stream(ckpt: Path) -> None:
    # a share above what any call of these prompts reaches: nothing streams
    stats = check_parity(ckpt, "75%", moe_stream_share=1.01, prompts=PROMPTS[:1])
    assert stats["streamed_calls"] == 0


@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 5 MoE layers of 8 experts (layer 0 is dense): at 50% (20 slots) a streamed step's
    # working set (40) is twice the pool, where the eviction order decides the loads
    family = FAMILIES["qwen3_moe"]
    path = tmp_path_factory.mktemp("qwen3_moe_deep")
    return family.checkpoint(path, seed=4, num_hidden_layers=6)


def _inline_reads(llm: LLM) -> None:
    """Every disk read runs when it is issued (prefetches too), not on the read threads: which
    prefetches are still loading, and so cancelled, at a later call is then fixed, and the
    load counts are exact."""
    pool = llm.engine.runner.expert_cache.reads
    submit = pool.submit

    def now(fn: Any, priority: int, tag: Any = None, defer: bool = False) -> Any:
        job = submit(fn, priority, tag, defer=True)
        if not defer:
            pool.wait(job)
        return job

    pool.submit = now  # type: ignore[method-assign]


def test_stream_eviction_keeps_parity_and_loads_no_more(deep_ckpt: Path) -> None:
    """stream_eviction on and off: greedy tokens equal transformers' both ways, prompts one at a
    time so that prefill steps stream (a share of 0.6: 5 of 8 experts) and decode steps (a
    token's 4 experts) do not; the step order loads fewer experts (misses plus prefetches)."""
    ref = hf_model(deep_ckpt)
    want = [hf_greedy(ref, prompt) for prompt in PROMPTS]
    loads = {}
    for on in (True, False):
        llm = LLM(str(deep_ckpt), expert_budget="50%", device="cpu", dtype="float32",
                  progress=False, moe_stream_share=0.6, late_reads=False,
                  stream_eviction=on)  # fmt: skip
        _inline_reads(llm)
        got = [moetier_greedy(llm, [prompt])[0] for prompt in PROMPTS]
        assert got == want
        llm.engine.runner.expert_cache.check_integrity()
        s = llm.offload_stats()
        assert s["streamed_calls"] > 0 and s["decode_steps"] > 0
        loads[on] = int(s["requests"] - s["device_hits"] + s["prefetches_issued"])
    assert loads[True] <= loads[False]
    assert loads == {True: 555, False: 575}


def test_stream_copy_now_reaches_the_cache_and_changes_no_decision(deep_ckpt: Path) -> None:
    """stream_copy_now only changes how a streamed prefetch's copies are issued (on CUDA: at
    once, whole); the cache's decisions are the same: the tokens and the load count of
    stream_eviction's run above."""
    ref = hf_model(deep_ckpt)
    want = [hf_greedy(ref, prompt) for prompt in PROMPTS]
    llm = LLM(str(deep_ckpt), expert_budget="50%", device="cpu", dtype="float32",
              progress=False, moe_stream_share=0.6, late_reads=False,
              stream_eviction=True, stream_copy_now=True)  # fmt: skip
    assert llm.engine.runner.expert_cache.stream_copy_now is True
    _inline_reads(llm)
    assert [moetier_greedy(llm, [prompt])[0] for prompt in PROMPTS] == want
    s = llm.offload_stats()
    assert int(s["requests"] - s["device_hits"] + s["prefetches_issued"]) == 555
