"""The device-resident expert cache on CUDA: parity with transformers at 50% (eager and whole
CUDA-graph replays), graphs really replayed with experts offloaded, the Triton fill reading
page-locked host rows, and no host sync inside a decode step. Run on the GPU machine with
`python3 -m pytest -m gpu tests/gpu`."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from moetier import LLM, SamplingParams
from tests.models.parity import PROMPTS, check_parity, moe_kernels_apply

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KW = dict(device_cache=True, host_budget="100%", moe_grouped_kernel=True)


@pytest.mark.parametrize("graphs", [False, True])
def test_device_cache_parity_cuda(ckpt: Path, graphs: bool) -> None:
    if not moe_kernels_apply(ckpt):
        pytest.skip("experts take the per-expert loop: no device cache")
    stats = check_parity(ckpt, "50%", device="cuda", cuda_graphs=graphs, **KW)
    assert stats["host_hits"] > 0 and stats["moe_calls_host_decode"] == 0


def test_device_cache_replays_whole_graphs_without_syncs(ckpt: Path) -> None:
    if not moe_kernels_apply(ckpt):
        pytest.skip("experts take the per-expert loop: no device cache")
    llm = LLM(str(ckpt), expert_budget="50%", device="cuda", dtype="bfloat16", progress=False,
              cuda_graphs=True, **KW)  # fmt: skip
    engine = llm.engine
    if engine.runner.graphs is None:  # recurrent state (Gated DeltaNet), DeepSeek-V4's attention
        pytest.skip("CUDA graphs are off for this family")
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # first decode step: captures
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.runner.execute(engine.scheduler.schedule())  # the step's forward only
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.replays >= 1
    assert graphs.graphs and not any(g.blocks for g in graphs.graphs.values())  # whole graphs
    assert len(syncs) <= 1, syncs  # the step's token ids copy in; nothing per MoE layer


def test_observed_steps_replay_and_log_every_call(ckpt: Path) -> None:
    """A routing observer (the bench's trace recorder) no longer forces eager steps: decode
    graphs replay with it attached, and it gets the records eager steps give it."""
    if not moe_kernels_apply(ckpt):
        pytest.skip("experts take the per-expert loop: no device cache")
    from moetier.bench.trace import TraceHeader, TraceRecorder

    traces = []
    for graphs in (True, False):
        llm = LLM(str(ckpt), expert_budget="50%", device="cuda", dtype="float32", progress=False,
                  cuda_graphs=graphs, **KW)  # fmt: skip
        runner = llm.engine.runner
        if graphs and runner.graphs is None:
            pytest.skip("CUDA graphs are off for host-sized attention")
        blocks = runner.model.moe_blocks()
        rec = TraceRecorder(TraceHeader(1, 1, 1, [b.layer for b in blocks], 1))
        rec.attach(blocks)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        llm.generate([PROMPTS[0]], params)
        rec.detach()
        if graphs:
            assert runner.graphs.replays >= 4
        traces.append([(r.layer, r.experts) for r in rec.trace.records])
    assert len(traces[0]) > 0 and traces[0] == traces[1]
