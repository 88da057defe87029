"""The expert kernels' activations on CUDA (kernels/expert_ffn.py ExpertMath: DeepSeek-V4's
CLAMPED_SWIGLU, gpt-oss's GPT_OSS_SWIGLU with its biases, the float32 top-k sum, Gemma 4's
GELU_TANH): the slot and grouped kernels equal the reference at real expert shapes with clamps
hit (fp32 to float tolerance, bf16 within a few ulps of the output's scale), and on experts
whose dot products are exact (one-hot rows) bit-equal to it but for the rare element where
Triton's exp and division round a float32 ulp off torch's; the Triton gelu (libdevice tanhf)
equals torch's CUDA gelu(approximate="tanh") on every bf16 value. The reference equals each
family's per-expert loop bit for bit (tests/models/test_deepseek_v4.py, test_gpt_oss.py,
test_gemma4.py). Run on the GPU machine with `python3 -m pytest -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from transformers.activations import ACT2FN

from moetier.kernels._expert_ffn_triton import activate
from moetier.kernels.expert_ffn import (
    CLAMPED_SWIGLU,
    GELU_TANH,
    GPT_OSS_SWIGLU,
    SILU,
    ExpertMath,
    expert_ffn,
    expert_ffn_reference,
)
from moetier.kernels.grouped_ffn import grouped_ffn, grouped_ffn_reference
from tests.unit.test_expert_ffn import clamp_hits, math_case, selection_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ACTS = {"v4": CLAMPED_SWIGLU, "gpt_oss": GPT_OSS_SWIGLU, "gemma4": GELU_TANH}
CLAMPED = ("gpt_oss", "v4")  # the activations with a limit (and the float32 top-k sum)
# (T, K, D, I, E): gpt-oss-20b's expert shape at decode and prefill sizes (160 pairs: the
# references gather every pair's expert, 4 GB each 40 tokens in fp32), and a ragged one
SHAPES = [(1, 4, 2880, 2880, 32), (4, 6, 1024, 768, 24), (40, 4, 2880, 2880, 32)]


def _run(
    kernel: str, x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, w: torch.Tensor,
    inter: int, e: int, math: ExpertMath, experts: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    if kernel == "slot":
        return expert_ffn(x, pool, slots, w, inter, None, math, experts)
    return grouped_ffn(x, pool, slots, w, inter, e, experts=experts, math=math)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("kernel", ["slot", "grouped"])
def test_kernels_match_reference(
    kernel: str, act: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    t, k, d, i, e = shape
    x, pool, slots, experts, w, math = math_case(ACTS[act], t, k, d, i, e, dtype, 3, "cuda")
    if act in CLAMPED:
        gate, up = clamp_hits(x, pool, slots, experts, i, math)
        assert gate > 0 and up > 0, (gate, up)
    got = _run(kernel, x, pool, slots, w, i, e, math, experts).float()
    want = expert_ffn_reference(x, pool, slots, w, i, None, math, experts).float()
    if kernel == "grouped":
        assert torch.equal(
            grouped_ffn_reference(x, pool, slots, w, i, None, None, math, experts).float(), want
        )
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"largest difference {err:.3g} of the output's scale"


@pytest.mark.parametrize("act", [SILU, CLAMPED_SWIGLU, GPT_OSS_SWIGLU, GELU_TANH])
@pytest.mark.parametrize("kernel", ["slot", "grouped"])
def test_kernels_round_as_the_reference_bf16(kernel: str, act: int) -> None:
    """Exact dot products (one-hot rows): every other difference is a rounding the kernel
    does elsewhere than the reference (a missed or extra one changes a large share)."""
    t, k, d, i, e = 64, 4, 512, 256, 16
    x, _, _, pool, experts, w = selection_case(t, k, d, i, e, torch.bfloat16, 2.0, 4, "cuda")
    g = torch.Generator("cuda").manual_seed(5)
    biases = None
    if act == GPT_OSS_SWIGLU:
        gate_up = torch.randn(e, 2 * i, generator=g, device="cuda").to(torch.bfloat16)
        down = torch.randn(e, d, generator=g, device="cuda").to(torch.bfloat16)
        biases = (gate_up[:, 0::2], gate_up[:, 1::2], down)
    math = ExpertMath(act, 1.0, 1.702, biases, topk_sum=act in (CLAMPED_SWIGLU, GPT_OSS_SWIGLU))
    got = _run(kernel, x, pool, experts, w, i, e, math, experts)
    want = expert_ffn_reference(x, pool, experts, w, i, None, math, experts)
    same = (got == want).float().mean().item()
    assert same > 0.995, f"{same:.4f} of the elements bit-equal"
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 2**-6, err


@pytest.mark.parametrize("act", CLAMPED)
def test_grouped_waves_continue_the_float32_sum(act: str) -> None:
    x, pool, slots, experts, w, math = math_case(
        ACTS[act], 40, 4, 512, 256, 16, torch.bfloat16, 6, "cuda"
    )
    whole = grouped_ffn(x, pool, slots, w, 256, 16, experts=experts, math=math)
    low = experts < 8
    out = torch.zeros(x.shape, device="cuda")  # float32: a topk_sum caller rounds once
    for part in (low, ~low):
        grouped_ffn(
            x, pool, slots.masked_fill(~part, -1), w, 256, 16, out, experts=experts, math=math
        )
    assert torch.equal(out.to(torch.bfloat16), whole)


def test_activation_kernels_replay_in_a_cuda_graph() -> None:
    """The slot and grouped kernels with biases (views of resident tensors) replay in a graph
    with new routing: biases read by expert id at replay, not captured values."""
    x, pool, slots, experts, w, math = math_case(
        GPT_OSS_SWIGLU, 8, 4, 512, 256, 16, torch.bfloat16, 7, "cuda"
    )
    s_static, e_static = slots.clone(), experts.clone()
    for kernel in ("slot", "grouped"):
        _run(kernel, x, pool, s_static, w, 256, 16, math, e_static)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _run(kernel, x, pool, s_static, w, 256, 16, math, e_static)
        for seed in (8, 9):
            _, _, new_slots, new_experts, _, _ = math_case(
                GPT_OSS_SWIGLU, 8, 4, 512, 256, 16, torch.bfloat16, seed, "cuda"
            )
            s_static.copy_(new_slots)
            e_static.copy_(new_experts)
            graph.replay()
            assert torch.equal(out, _run(kernel, x, pool, new_slots, w, 256, 16, math, new_experts))


@triton.jit
def _act_kernel(g_ptr, u_ptr, h_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """h = activate(g, u) elementwise (no biases, no limit), in h's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = activate(g, u, 0.0, 0.0, 0.0, 1.0, h_ptr.dtype.element_ty, ACT, False)
    tl.store(h_ptr + offs, h, mask=m)


def test_gemma4_gelu_tanh_equals_torch_on_every_bf16_value() -> None:
    """The kernels' GELU_TANH (`activate`: gelu in float32 as PyTorch's CUDA kernel computes
    it, libdevice's tanhf, rounded, times up rounded) equals the per-expert loop's
    ACT2FN["gelu_pytorch_tanh"](g) * u on CUDA for every finite bf16 and float16 gate, and 4M
    random float32 ones."""
    gen = torch.Generator("cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if dtype == torch.float32:  # 4M random float32 gates
            g = 4 * torch.randn(1 << 22, generator=gen, device="cuda")
        else:
            every = torch.arange(1 << 16, dtype=torch.int32, device="cuda").to(torch.int16)
            g = every.view(dtype)
            g = g[g.isfinite()]
        for u in (torch.ones_like(g), torch.randn(g.shape, generator=gen, device="cuda").to(dtype)):
            h = torch.empty_like(g)
            _act_kernel[(triton.cdiv(g.numel(), 1024),)](g, u, h, g.numel(), GELU_TANH, 1024)
            want = ACT2FN["gelu_pytorch_tanh"](g) * u
            bad = h != want
            assert not bad.any(), (
                dtype,
                g[bad][:8].tolist(),
                h[bad][:8].tolist(),
                want[bad][:8].tolist(),
            )
