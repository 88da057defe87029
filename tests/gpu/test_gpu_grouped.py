"""The grouped expert kernel on the GPU (kernels/grouped_ffn.py): equals its reference at real
shapes and token counts from decode to prefill, with waves skipped and continued, replays
inside a CUDA graph with new routing, and a fresh prompt's attention runs SDPA's flash kernel.
Run on the GPU machine with `bash scripts/gpu_check.sh`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetier import LLM, SamplingParams
from moetier.kernels.expert_ffn import expert_ffn
from moetier.kernels.grouped_ffn import grouped_ffn, grouped_ffn_reference
from tests.models.parity import check_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _case(t: int, k: int, d: int, i: int, s: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, d, generator=g, device="cuda").to(dtype)
    pool = (torch.randn(s, 3 * i * d, generator=g, device="cuda") / d**0.5).to(dtype)
    slots = torch.rand(t, s, generator=g, device="cuda").argsort(-1)[:, :k].sort(-1).values
    w = torch.rand(t, k, generator=g, device="cuda")
    return x, pool, slots.to(torch.int32), w


@pytest.mark.parametrize("t", [1, 7, 64, 600])
def test_grouped_kernel_equals_reference_qwen3_shape(t: int) -> None:
    x, pool, slots, w = _case(t, 8, 2048, 768, 24, torch.bfloat16, seed=t)
    got = grouped_ffn(x, pool, slots, w, 768, 24)
    want = grouped_ffn_reference(x, pool, slots, w, 768)
    # tensor-core partial sums in another order than cuBLAS: a bf16 ulp or two at the output
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)
    slot = expert_ffn(x, pool, slots, w, 768)  # the slot kernel: the same contract
    torch.testing.assert_close(got.float(), slot.float(), rtol=2**-6, atol=2**-6)


def test_grouped_kernel_fp32_waves() -> None:
    x, pool, slots, w = _case(50, 6, 256, 96, 12, torch.float32, seed=3)
    whole = grouped_ffn_reference(x, pool, slots, w, 96)
    low = slots < 6
    out = grouped_ffn(x, pool, slots.masked_fill(~low, -1), w, 96, 12)
    grouped_ffn(x, pool, slots.masked_fill(low, -1), w, 96, 12, out)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)


def test_grouped_kernel_replays_in_a_cuda_graph() -> None:
    x, pool, slots, w = _case(96, 8, 512, 128, 32, torch.bfloat16, seed=5)
    static = slots.clone()
    grouped_ffn(x, pool, static, w, 128, 32)  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_ffn(x, pool, static, w, 128, 32)
    for seed in (6, 7):
        _, _, new, _ = _case(96, 8, 512, 128, 32, torch.bfloat16, seed=seed)
        static.copy_(new)
        graph.replay()
        assert torch.equal(out, grouped_ffn(x, pool, new, w, 128, 32))


def test_grouped_kernel_parity_every_budget(ckpt: Path) -> None:
    for budget in (None, "50%"):
        check_parity(
            ckpt, budget, device="cuda", moe_grouped_kernel=True, moe_slot_kernel_max_pairs=0
        )


def test_fresh_prompt_attention_runs_flash(ckpt: Path) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moetier.layers.attention import Attention

    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", progress=False, cuda_graphs=False)
    if not any(isinstance(m, Attention) for m in llm.engine.runner.model.modules()):
        pytest.skip("MLA: key and value head sizes differ, flash does not apply")
    if any(getattr(m, "window", None) for m in llm.engine.runner.model.modules()):
        pytest.skip("sliding-window layers (window < the prompt) attend with a mask")
    llm.engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot run these inputs
        llm.engine.step()  # the prompt step
