"""Host syncs on CUDA: a decode step syncs the same number of times whatever the expert budget
and whichever MoE compute path, so fetching never makes the host wait on the GPU.

Counts the syncs PyTorch reports with `torch.cuda.set_sync_debug_mode("warn")` during one
decode step. Run on the GPU machine with `bash scripts/gpu_check.sh`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from moetier import LLM, SamplingParams
from tests.models.parity import PROMPTS, min_budget

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def decode_step_syncs(path: Path, expert_budget: str | None, grouped_max_bytes: int) -> int:
    llm = LLM(
        str(path),
        expert_budget=expert_budget,
        device="cuda",
        dtype="bfloat16",
        progress=False,
        moe_grouped_max_bytes=grouped_max_bytes,
    )
    engine = llm.engine
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # first decode step: warms every lazily built buffer
    counts = []
    for _ in range(2):  # the first counted step may still meet one-time lazy initialisation
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    while engine.has_unfinished():
        engine.step()
    return counts[-1]


def test_decode_step_syncs_do_not_depend_on_budget_or_path(ckpt: Path) -> None:
    counts = {
        (budget, path): decode_step_syncs(ckpt, budget, grouped)
        for budget in (None, min_budget(ckpt, dtype_bytes=2))
        for path, grouped in (("loop", 0), ("grouped", 1 << 30))
    }
    print(f"host syncs per decode step, {ckpt.name}: {counts}")
    assert len(set(counts.values())) == 1, counts
    assert next(iter(counts.values())) > 0  # the counter sees the routing-id reads
