"""CUDA-graph prefill of fresh prompts (engine/prefill_graphs.py): replays equal eager prefill.

Every family, each MoE kernel (slot, grouped), every expert resident and with the device cache:
greedy tokens with prefill graphs on equal those with them off (decode graphs on in both), the
last prompt token's logits agree within check_parity's float32 tolerance, graphs were really
replayed, prompts of other lengths in one bucket reuse its graph, a prompt above the largest
bucket runs eagerly, and the captured attention is SDPA's flash kernel. Run on the GPU machine
with
`python3 -m pytest -m gpu tests/gpu/test_gpu_prefill_graphs.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moetier import LLM, SamplingParams
from tests.models.parity import (
    PROMPTS,
    moe_kernels_apply,
    moetier_greedy,
    prefill_graphs_apply,
    prefill_graphs_off,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KERNELS = {  # MoE kernel path -> the switches that force it (as tests/gpu/test_gpu_syncs.py)
    "slot": dict(moe_grouped_kernel=False, moe_slot_kernel_max_pairs=1 << 20),
    "grouped": dict(moe_grouped_kernel=True, moe_slot_kernel_max_pairs=0),
}
DEVICE_CACHE = dict(device_cache=True, host_budget="100%", moe_grouped_kernel=True)
# PROMPTS (6, 3 and 13 tokens) share the 16-token bucket; LONG takes the 64-token one
LONG = [(7 * i + 3) % 200 for i in range(40)]
TOL = dict(rtol=1e-4, atol=1e-4)  # check_parity's float32 logits tolerance


def _llm(ckpt: Path, **kw: Any) -> LLM:
    # no prefix cache: a prompt seen before would start past its cached blocks (not fresh)
    return LLM(
        str(ckpt),
        device="cuda",
        dtype="float32",
        progress=False,
        enable_prefix_caching=False,
        **kw,
    )


def _each_alone(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [moetier_greedy(llm, [p])[0] for p in prompts]


def _check_equal(llm: LLM, eager: LLM, prompts: list[list[int]]) -> None:
    """Same greedy tokens, each prompt alone; last-token logits within TOL."""
    assert _each_alone(llm, prompts) == _each_alone(eager, prompts)
    for p in prompts:
        torch.testing.assert_close(llm.prompt_logits(p), eager.prompt_logits(p), **TOL)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_prefill_replays_equal_eager_prefill(ckpt: Path, kernel: str) -> None:
    if prefill_graphs_off(ckpt):
        pytest.skip("recurrent-state layers or host-sized attention: no prefill graphs")
    kw = dict(expert_budget=None, **KERNELS[kernel])
    eager = _llm(ckpt, prefill_graphs=False, **kw)
    llm = _llm(ckpt, **kw)
    prompts = [*PROMPTS, LONG]
    _check_equal(llm, eager, prompts)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and eager.engine.runner.prefill_graphs is None
    assert not graphs.failed, graphs.failed
    if not moe_kernels_apply(ckpt):  # per-expert loop: not graph-safe, prefill stays eager
        assert graphs.replays == 0 and not graphs.graphs
        return
    # one replay per prompt step and per prompt_logits; the three short prompts, of three
    # lengths, replay the one 16-token graph
    assert graphs.replays == 2 * len(prompts)
    assert sorted(graphs.graphs) == [16, 64]
    stats, want = llm.offload_stats(), eager.offload_stats()
    assert stats["prefill_graph_replays"] == graphs.replays
    assert want["prefill_graph_replays"] == 0
    decode = llm.engine.runner.graphs
    assert decode is not None and stats["decode_graph_replays"] == decode.replays > 0
    # the host counters count the prompts' tokens as the eager steps do, never the pads
    counted = ("_steps", "resident_lookups", "moe_calls", "token_lookups")
    keys = [k for k in want if any(c in k for c in counted)]
    assert {k: stats[k] for k in keys} == {k: want[k] for k in keys}
    llm.engine.check_integrity()


def test_prompt_above_the_largest_bucket_runs_eagerly(ckpt: Path) -> None:
    if not prefill_graphs_apply(ckpt):
        pytest.skip("no CUDA graphs for this family (per-expert loop or recurrent state)")
    eager = _llm(ckpt, expert_budget=None, prefill_graphs=False)
    llm = _llm(ckpt, expert_budget=None, prefill_graph_max_tokens=16)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == (16,)
    assert _each_alone(llm, [LONG]) == _each_alone(eager, [LONG])  # 40 tokens > 16
    assert graphs.replays == 0 and not graphs.graphs
    assert _each_alone(llm, [PROMPTS[2]]) == _each_alone(eager, [PROMPTS[2]])  # 13 tokens
    assert graphs.replays == 1 and list(graphs.graphs) == [16]
    assert llm.offload_stats()["prefill_graph_replays"] == 1


def test_device_cache_prefill_replays_equal_eager_prefill(ckpt: Path) -> None:
    """Experts offloaded with the device cache (slots resolved on the device): prefill graphs
    qualify; the pads' experts are resolved too (extra fills, counted by the device cache)."""
    if not prefill_graphs_apply(ckpt):
        pytest.skip("no CUDA graphs for this family (per-expert loop or recurrent state)")
    eager = _llm(ckpt, expert_budget="50%", prefill_graphs=False, **DEVICE_CACHE)
    llm = _llm(ckpt, expert_budget="50%", **DEVICE_CACHE)
    prompts = [*PROMPTS, LONG]
    _check_equal(llm, eager, prompts)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and not graphs.failed, graphs
    assert graphs.replays == 2 * len(prompts) and sorted(graphs.graphs) == [16, 64]
    stats = llm.offload_stats()
    assert stats["host_hits"] > 0 and stats["moe_calls_host_prefill"] == 0
    llm.engine.runner.expert_cache.check_integrity()


def test_overridden_routing_is_staged_for_prefill_replays(ckpt: Path) -> None:
    """The bench's routing override: each replay stages the prompt's own draw (pads get fixed
    ids), so tokens equal eager prefill's, which draws per call."""
    if not prefill_graphs_apply(ckpt):
        pytest.skip("no CUDA graphs for this family (per-expert loop or recurrent state)")
    from moetier.bench.routing_override import UniformRouting, install

    def run(**kw: Any) -> tuple[list[list[int]], Any]:
        llm = _llm(ckpt, expert_budget=None, **kw)
        runner = llm.engine.runner
        install(runner.model.moe_blocks(), UniformRouting(runner.num_experts, runner.top_k, 1))
        return _each_alone(llm, [*PROMPTS, LONG]), runner.prefill_graphs

    got, graphs = run()
    want, _ = run(prefill_graphs=False)
    assert got == want
    assert graphs is not None and graphs.staged and not graphs.failed
    assert graphs.replays == len(PROMPTS) + 1


def _flash_only_prompt(llm: LLM) -> BaseException | None:
    """Run a 39-token prompt's step with SDPA restricted to flash; the step's error, if any
    (the engine fails the request and goes on)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    llm.engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # any other kernel raises
        llm.engine.step()  # the prompt step
    while llm.engine.has_unfinished():
        llm.engine.step()
    return llm.engine.last_error


def test_captured_prefill_attention_runs_flash(ckpt: Path) -> None:
    """bf16: the prompt's warm-up, capture and replay run with flash as the only SDPA kernel
    (a fresh prompt's attention is `is_causal`, no mask, inside the graph as in eager; MLA's
    in the expanded form, values padded to the key head size)."""
    from moetier.layers.attention import Attention
    from moetier.layers.mla import MLAttention

    if not prefill_graphs_apply(ckpt):
        pytest.skip("no CUDA graphs for this family (per-expert loop or recurrent state)")
    kw = dict(expert_budget=None, device="cuda", dtype="bfloat16", progress=False)
    eager = LLM(str(ckpt), prefill_graphs=False, **kw)
    modules = list(eager.engine.runner.model.modules())
    if not any(isinstance(m, (Attention, MLAttention)) for m in modules):
        pytest.skip("no attention layer this test knows")
    if any(getattr(m, "window", None) or getattr(m, "chunk", None) for m in modules):
        pytest.skip("sliding-window or chunked layers attend with a mask")
    if _flash_only_prompt(eager) is not None:
        pytest.skip(f"flash does not run this prompt eagerly either: {eager.engine.last_error}")
    llm = LLM(str(ckpt), **kw)
    assert _flash_only_prompt(llm) is None, llm.engine.last_error
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and not graphs.failed, graphs.failed
    assert graphs.replays == 1 and list(graphs.graphs) == [64]
