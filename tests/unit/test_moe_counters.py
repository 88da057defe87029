"""Engine-step and MoE-call counters: exact (token, expert) lookups before the per-step dedup,
and distinct experts per layer call where routing goes to the host, checked against a trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moetier import LLM, SamplingParams
from moetier.bench.trace import TraceHeader, TraceRecorder
from moetier.offload.stats import OffloadStats
from tests.models.families import FAMILIES

PROMPTS = [[5, 9, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
NEW = 6  # tokens per request: one prefill step for both prompts, then NEW - 1 decode steps
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
KINDS = ("decode", "prefill")


@pytest.fixture(scope="module", params=["mixtral", "deepseek_v2"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # deepseek_v2's first layer is dense: MoE layers != decoder layers
    return FAMILIES[request.param].checkpoint(tmp_path_factory.mktemp(request.param), seed=5)


def _llm(path: Path, **kw: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", progress=False, **kw)


def _run(llm: LLM) -> tuple[dict[str, float], list[list[int]]]:
    outs = llm.generate(PROMPTS, GREEDY)
    return llm.offload_stats(), [o.outputs[0].token_ids for o in outs]


def _check_totals(s: dict[str, float], llm: LLM) -> None:
    """Steps, calls and lookups that follow from the prompt lengths alone."""
    k, layers = llm.engine.runner.top_k, len(llm.engine.runner.model.moe_blocks())
    prefill_tokens = sum(len(p) for p in PROMPTS)
    decode_tokens = len(PROMPTS) * (NEW - 1)  # the last sampled token is never fed back
    assert (s["prefill_steps"], s["decode_steps"], s["engine_steps"]) == (1, NEW - 1, NEW)
    assert s["moe_calls"] == NEW * layers
    assert s["token_lookups"] == (prefill_tokens + decode_tokens) * k * layers
    for kind, tokens, steps in (("prefill", prefill_tokens, 1), ("decode", decode_tokens, NEW - 1)):
        calls = s[f"moe_calls_host_{kind}"] + s[f"moe_calls_device_{kind}"]
        pairs = s[f"token_lookups_host_{kind}"] + s[f"token_lookups_device_{kind}"]
        assert (calls, pairs) == (steps * layers, tokens * k * layers), kind


def test_offloaded_counts_match_the_recorded_trace(ckpt: Path) -> None:
    llm = _llm(ckpt, expert_budget="50%")
    runner = llm.engine.runner
    blocks = runner.model.moe_blocks()
    header = TraceHeader(
        int(runner.hf_config.num_hidden_layers),
        int(runner.num_experts),
        int(runner.top_k),
        [int(b.layer) for b in blocks],
    )
    recorder = TraceRecorder(header)
    recorder.attach(blocks)
    s, _ = _run(llm)
    recorder.detach()
    _check_totals(s, llm)
    assert s["evictions"] > 0  # the budget makes the cache miss and evict
    records = recorder.trace.records
    prefill_rows = sum(len(p) for p in PROMPTS)
    by_kind = {
        "prefill": [r for r in records if len(r.experts) == prefill_rows],
        "decode": [r for r in records if len(r.experts) == len(PROMPTS)],
    }
    assert sum(map(len, by_kind.values())) == len(records) == s["moe_calls"]
    for kind in KINDS:
        recs = by_kind[kind]
        assert s[f"moe_calls_host_{kind}"] == len(recs) and s[f"moe_calls_device_{kind}"] == 0
        assert s[f"token_lookups_host_{kind}"] == sum(len(r.experts) * header.top_k for r in recs)
        assert s[f"distinct_lookups_host_{kind}"] == sum(len(r.distinct()) for r in recs)
    distinct = s["distinct_lookups_host_decode"] + s["distinct_lookups_host_prefill"]
    assert distinct == s["requests"]  # one cache lookup per distinct expert per call
    assert distinct < s["token_lookups"]  # the prefill of 14 tokens shares experts


def test_slot_kernel_path_counts_the_same(ckpt: Path) -> None:
    """The one-wave slot-kernel path (forced on the CPU) dedups and counts like the waves."""
    loop, tokens = _run(_llm(ckpt, expert_budget="50%"))
    llm = _llm(ckpt, expert_budget="50%", moe_slot_kernel_max_pairs=1 << 20)
    kernel, kernel_tokens = _run(llm)
    assert kernel_tokens == tokens
    _check_totals(kernel, llm)
    keys = [
        f"{c}_host_{k}" for c in ("moe_calls", "token_lookups", "distinct_lookups") for k in KINDS
    ]
    assert {k: kernel[k] for k in keys} == {k: loop[k] for k in keys}


def test_all_resident_path_counts_calls_but_not_distinct(ckpt: Path) -> None:
    """No routing sync on the device-table path: calls and lookups are host arithmetic, the
    distinct experts are not measured (and not guessed)."""
    llm = _llm(ckpt, moe_slot_kernel_max_pairs=1 << 20)
    s, _ = _run(llm)
    _check_totals(s, llm)
    for kind in KINDS:
        assert s[f"moe_calls_host_{kind}"] == s[f"token_lookups_host_{kind}"] == 0
        assert s[f"distinct_lookups_host_{kind}"] == 0
    assert s["resident_lookups"] == s["token_lookups"] > 0
    assert s["routing_sync_s"] == 0.0 and s["requests"] == 0


def test_stats_step_kind_reset_and_restore() -> None:
    st = OffloadStats()
    st.count_host_call(6, 4)  # outside an engine step: counted as prefill
    st.begin_step(decode=True)
    st.count_host_call(4, 3)
    st.count_device_calls(12, calls=3)
    st.end_step()
    saved = st.save_counts()
    st.begin_step(decode=False)
    st.count_device_calls(2)
    st.restore_counts(saved)
    d = st.to_dict()
    assert (d["decode_steps"], d["prefill_steps"], d["engine_steps"]) == (1, 0, 1)
    assert (d["moe_calls_host_prefill"], d["token_lookups_host_prefill"]) == (1, 6)
    assert d["distinct_lookups_host_prefill"] == 4 and d["distinct_lookups_host_decode"] == 3
    assert (d["moe_calls_device_decode"], d["token_lookups_device_decode"]) == (3, 12)
    assert d["moe_calls_device_prefill"] == 0 and d["resident_lookups"] == 12
    assert (d["moe_calls"], d["token_lookups"]) == (5, 22)
    st.reset()
    assert st.to_dict()["token_lookups"] == 0 and st.to_dict()["engine_steps"] == 0
