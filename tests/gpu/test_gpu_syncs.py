"""Host syncs on CUDA per decode step: the per-expert loop and the grouped path sync once per MoE
layer (routing ids) plus a fixed few, whatever the budget, so fetching never adds a wait; the
slot-reading kernel path needs no MoE-layer sync at all when every expert is resident.

Counts the syncs PyTorch reports with `torch.cuda.set_sync_debug_mode("warn")` during one
decode step. Run on the GPU machine with `bash scripts/gpu_check.sh`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from moetier import LLM, SamplingParams
from tests.models.parity import PROMPTS, min_budget, moe_kernels_apply

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


PATHS = {  # MoE compute path -> (moe_grouped_kernel, moe_slot_kernel_max_pairs)
    "loop": (False, 0),
    "grouped": (True, 0),  # the grouped kernel for every step
    "slot": (False, 1 << 20),
    "graphs": (False, 1 << 20),  # the slot path, decode steps replayed as CUDA graphs
}


def decode_step_syncs(path: Path, expert_budget: str | None, moe_path: str) -> tuple[int, int]:
    """(host syncs in one decode step, number of MoE layers)."""
    grouped, slot = PATHS[moe_path]
    llm = LLM(
        str(path),
        expert_budget=expert_budget,
        device="cuda",
        dtype="bfloat16",
        progress=False,
        moe_grouped_kernel=grouped,
        moe_slot_kernel_max_pairs=slot,
        cuda_graphs=moe_path == "graphs",
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
    return counts[-1], len(llm.engine.runner.model.moe_blocks())


def test_decode_step_syncs_per_budget_and_path(ckpt: Path) -> None:
    counts = {}
    for budget in (None, min_budget(ckpt, dtype_bytes=2)):
        for moe_path in PATHS:
            counts[(budget, moe_path)], moe_layers = decode_step_syncs(ckpt, budget, moe_path)
    print(f"host syncs per decode step, {ckpt.name} ({moe_layers} MoE layers): {counts}")
    if not moe_kernels_apply(ckpt):  # every path is the loop, graphs never capture
        assert len(set(counts.values())) == 1, counts
        return
    base = counts[(None, "slot")]  # no MoE-layer sync: what the rest of the step costs
    for (budget, moe_path), n in counts.items():
        if moe_path == "graphs" and budget is None:
            assert n <= base, counts  # one replay: never more syncs than the eager step
        else:
            # with every expert resident both kernels look slots up on the device: no sync
            resident_kernel = budget is None and moe_path in ("slot", "grouped")
            want = base if resident_kernel else base + moe_layers
            assert n == want, (budget, moe_path, counts)
