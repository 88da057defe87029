"""kernels/expert_ffn.py: the reference equals a per-pair loop; the Triton kernel equals the
reference (run by Triton's interpreter on the CPU when Triton is installed), for every
activation code (with clamps hit, biases and the float32 top-k sum)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moetier.kernels.expert_ffn import (
    CLAMPED_SWIGLU,
    GELU_TANH,
    GPT_OSS_SWIGLU,
    SILU,
    ExpertMath,
    activate,
    expert_ffn_reference,
)


def _case(t: int, k: int, d: int, i: int, s: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    pool = (torch.randn(s, 3 * i * d, generator=g) / d**0.5).to(dtype)
    slots = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return x, pool, slots, w


def test_reference_matches_per_pair_loop_fp32() -> None:
    x, pool, slots, w = _case(3, 4, 24, 10, 7, torch.float32)
    t, k = slots.shape
    d, i = 24, 10
    want = torch.zeros(t, d)
    for a in range(t):
        for j in range(k):
            row = pool[slots[a, j]]
            gate, up = row[: i * d].view(i, d), row[i * d : 2 * i * d].view(i, d)
            down = row[2 * i * d :].view(d, i)
            h = F.silu(gate @ x[a]) * (up @ x[a])
            want[a] += (down @ h) * w[a, j]
    got = expert_ffn_reference(x, pool, slots, w, i)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def math_case(
    act: int,
    t: int,
    k: int,
    d: int,
    i: int,
    e: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ExpertMath]:
    """(x [T, D], pool [E, 3ID] (slot s holds expert perm[s]), slots [T, K], experts [T, K]
    ascending, weights [T, K], math) on `device`: projections ~N(0, 4), so a limit of 1.5
    clamps about half of them; gpt-oss gets interleaved gate/up biases (strided views, as the
    model passes them) and a down bias. Clamped codes take the top-k sum, as their families
    do (SILU and GELU_TANH add in order)."""
    g = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    x = (2 * torch.randn(t, d, **kw)).to(dtype)
    pool = (torch.randn(e, 3 * i * d, **kw) / d**0.5).to(dtype)
    experts = torch.rand(t, e, **kw).argsort(-1)[:, :k].sort(-1).values
    slot_of = torch.randperm(e, **kw)  # expert -> slot: one slot per expert
    w = torch.rand(t, k, **kw)
    biases = None
    if act == GPT_OSS_SWIGLU:
        gate_up = torch.randn(e, 2 * i, **kw).to(dtype)
        biases = (gate_up[:, 0::2], gate_up[:, 1::2], torch.randn(e, d, **kw).to(dtype))
    math = ExpertMath(act, 1.5, 1.702, biases, topk_sum=act in (CLAMPED_SWIGLU, GPT_OSS_SWIGLU))
    return x, pool, slot_of[experts], experts, w, math


def selection_case(
    t: int,
    k: int,
    d: int,
    i: int,
    e: int,
    dtype: torch.dtype,
    scale: float,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts whose matrices each select one coordinate per row (a single 1): every dot
    product is exact in any order, so kernel, reference and per-expert loop agree bit for bit
    wherever they round alike. (x [T, D] ~ scale * N(0, 1), gate_up [E, 2I, D], down [E, D, I],
    pool [E, 3ID] (slot s holds expert s), experts [T, K] ascending, weights [T, K] float32)."""
    g = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=g, device=device)

    def select(rows: int, cols: int) -> torch.Tensor:
        one = torch.randint(cols, (e, rows, 1), **kw)
        return torch.zeros(e, rows, cols, device=device).scatter_(2, one, 1.0).to(dtype)

    gate_up, down = select(2 * i, d), select(d, i)
    x = (scale * torch.randn(t, d, **kw)).to(dtype)
    pool = torch.cat([gate_up.flatten(1), down.flatten(1)], dim=1)
    experts = torch.rand(t, e, **kw).argsort(-1)[:, :k].sort(-1).values
    return x, gate_up, down, pool, experts, torch.rand(t, k, **kw)


def loop_output(
    block: Any, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    experts: torch.Tensor, w: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """What MoEBlock's per-expert loop computes with a family block's `expert_mlp`: each term
    r(y * w) in x's dtype, a token's terms summed at once (`topk_sum`) or added in order."""
    terms = []
    for j in range(experts.shape[1]):
        rows = [
            block.expert_mlp(x[a : a + 1], gate_up[ex], down[ex], ex)
            for a, ex in enumerate(experts[:, j].tolist())
        ]
        terms.append((torch.cat(rows) * w[:, j : j + 1]).to(x.dtype))
    if block.topk_sum:
        return torch.stack(terms, dim=1).sum(dim=1)
    out = torch.zeros_like(x)
    for term in terms:
        out += term
    return out


def clamp_hits(
    x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor, i: int,
    math: ExpertMath,
) -> tuple[int, int]:  # fmt: skip
    """(gate entries above the limit, up entries beyond ±limit) the case's pairs clamp."""
    d = x.shape[1]
    w = pool[slots.reshape(-1)].float()  # [P, 3ID]
    xp = x.float().repeat_interleave(slots.shape[1], 0)[:, :, None]  # [P, D, 1]
    g = torch.bmm(w[:, : i * d].view(-1, i, d), xp)[..., 0]  # [P, I]
    u = torch.bmm(w[:, i * d : 2 * i * d].view(-1, i, d), xp)[..., 0]
    if math.biases is not None:
        ids = experts.reshape(-1)
        g, u = g + math.biases[0][ids].float(), u + math.biases[1][ids].float()
    return int((g > math.limit).sum()), int((u.abs() > math.limit).sum())


def test_reference_activations_match_per_pair_loop_fp32() -> None:
    d, i = 24, 10
    for act in (CLAMPED_SWIGLU, GPT_OSS_SWIGLU, GELU_TANH):
        x, pool, slots, experts, w, math = math_case(act, 3, 4, d, i, 9, torch.float32, seed=1)
        assert min(clamp_hits(x, pool, slots, experts, i, math)) > 0
        want = torch.zeros(3, d)
        for a in range(3):
            for j in range(4):
                row, ex = pool[slots[a, j]], experts[a, j]
                gate, up = row[: i * d].view(i, d), row[i * d : 2 * i * d].view(i, d)
                down = row[2 * i * d :].view(d, i)
                gv, uv = gate @ x[a], up @ x[a]
                if math.biases is not None:
                    gv, uv = gv + math.biases[0][ex], uv + math.biases[1][ex]
                if act == GELU_TANH:  # no clamp (the entries beyond 1.5 count)
                    h = F.gelu(gv, approximate="tanh") * uv
                elif act == CLAMPED_SWIGLU:
                    gv, uv = gv.clamp(max=1.5), uv.clamp(-1.5, 1.5)
                    h = F.silu(gv) * uv
                else:
                    gv, uv = gv.clamp(max=1.5), uv.clamp(-1.5, 1.5)
                    h = (uv + 1) * gv * torch.sigmoid(1.702 * gv)
                y = down @ h + (0 if math.biases is None else math.biases[2][ex])
                want[a] += y * w[a, j]
        got = expert_ffn_reference(x, pool, slots, w, i, math=math, experts=experts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_gelu_tanh_equals_gemma4_loop_bitwise_bf16() -> None:
    # GELU_TANH is the per-expert loop's ACT2FN["gelu_pytorch_tanh"](g) * u: the gelu in
    # float32 rounded once, the product rounded; on random values and every finite bf16 gate
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(0)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.cat([(3 * torch.randn(4096, generator=gen)).to(torch.bfloat16), every])
    g = g[g.float().isfinite()].view(-1, 16)
    u = torch.randn(g.shape, generator=gen).to(torch.bfloat16)
    want = ACT2FN["gelu_pytorch_tanh"](g) * u
    got = activate(g, u, ExpertMath(GELU_TANH, limit=1.5), None)
    assert torch.equal(got, want)
    # the rounding is the loop's: gelu rounded to bf16 before the product (once in float32
    # differs), and no clamp at `limit`
    assert not torch.equal(got, (F.gelu(g.float(), approximate="tanh") * u.float()).bfloat16())
    assert not torch.equal(got, activate(g, u, ExpertMath(SILU), None))


def test_reference_topk_sum_rounds_once_bf16() -> None:
    # the clamped families' terms are added in float32 and rounded once; plain silu's after
    # each add (the two differ on some bf16 element here)
    x, pool, slots, experts, w, math = math_case(CLAMPED_SWIGLU, 6, 4, 32, 16, 8, torch.bfloat16)
    got = expert_ffn_reference(x, pool, slots, w, 16, math=math, experts=experts)
    parts = [
        expert_ffn_reference(x, pool, slots[:, j : j + 1], w[:, j : j + 1], 16, math=math)
        for j in range(4)
    ]
    assert torch.equal(got, sum(p.float() for p in parts).to(torch.bfloat16))
    rounded = torch.zeros_like(x)
    for p in parts:
        rounded += p
    assert not torch.equal(got, rounded)


def test_reference_adds_in_slot_order_with_rounding_bf16() -> None:
    # y_0 + y_1 rounded after each add: swapping the order may change bf16 bits, the contract
    # is the given (ascending expert) order.
    x, pool, slots, w = _case(2, 3, 16, 8, 5, torch.bfloat16, seed=4)
    got = expert_ffn_reference(x, pool, slots, w, 8)
    parts = [
        expert_ffn_reference(x, pool, slots[:, j : j + 1], w[:, j : j + 1], 8) for j in range(3)
    ]
    acc = torch.zeros_like(x)
    for p in parts:
        acc += p
    assert torch.equal(got, acc)


_KERNEL_CHECK = """
import torch
from moetier.kernels.expert_ffn import expert_ffn, expert_ffn_reference, triton_available
assert triton_available()
g = torch.Generator().manual_seed(0)
for t, k, d, i, s in [(1, 2, 48, 40, 6), (3, 4, 160, 72, 10), (2, 8, 130, 33, 9)]:
    x = torch.randn(t, d, generator=g)
    pool = torch.randn(s, 3 * i * d, generator=g) / d**0.5
    slots = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    torch.testing.assert_close(
        expert_ffn(x, pool, slots, w, i), expert_ffn_reference(x, pool, slots, w, i),
        rtol=1e-5, atol=1e-5)
# every launch shape the chooser may pick computes the same thing (both down variants)
from moetier.kernels._expert_ffn_triton import FfnConfig, expert_ffn_triton
t, k, d, i, s = 2, 3, 130, 72, 7
x = torch.randn(t, d, generator=g).to(torch.bfloat16)
pool = (torch.randn(s, 3 * i * d, generator=g) / d**0.5).to(torch.bfloat16)
slots = torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)]).sort(-1).values
w = torch.rand(t, k, generator=g)
base = expert_ffn_triton(x, pool, slots, w, i, FfnConfig())
for cfg in [FfnConfig(split_down=True), FfnConfig(up_bn=8, up_bk=256, split_down=True,
            down_bn=64, down_bk=64), FfnConfig(up_bn=64, up_bk=32, down_bn=4, down_bk=256)]:
    got = expert_ffn_triton(x, pool, slots, w, i, cfg)
    # the same products; fp32 partial sums in another order may move a bf16 result one ulp
    torch.testing.assert_close(got.float(), base.float(), rtol=2**-7, atol=2**-7)
print("ok")
"""


_ACT_CHECK = """
import torch
from moetier.kernels.expert_ffn import (
    CLAMPED_SWIGLU, GELU_TANH, GPT_OSS_SWIGLU, expert_ffn_reference)
from moetier.kernels._expert_ffn_triton import FfnConfig, expert_ffn_triton
from tests.unit.test_expert_ffn import clamp_hits, math_case
for act in (CLAMPED_SWIGLU, GPT_OSS_SWIGLU, GELU_TANH):
    for t, k, d, i, e in [(1, 4, 48, 40, 6), (3, 2, 130, 33, 9)]:
        x, pool, slots, experts, w, math = math_case(act, t, k, d, i, e, torch.float32, seed=act)
        gate, up = clamp_hits(x, pool, slots, experts, i, math)
        assert gate > 0 and up > 0, (gate, up)
        want = expert_ffn_reference(x, pool, slots, w, i, math=math, experts=experts)
        # both down projections: one kernel walking a token's pairs, or pairs then a combine
        for cfg in [FfnConfig(), FfnConfig(up_bn=8, split_down=True, down_bn=64, down_bk=32)]:
            got = expert_ffn_triton(x, pool, slots, w, i, cfg, math=math, experts=experts)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_triton_activations_match_reference_in_interpreter() -> None:
    _run_in_interpreter(_ACT_CHECK)


def _run_in_interpreter(code: str) -> None:
    """Run `code` in a fresh process with Triton's CPU interpreter on (it is read at import)."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}")
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_triton_kernel_matches_reference_in_interpreter() -> None:
    _run_in_interpreter(_KERNEL_CHECK)


_NORM_ROPE_CHECK = """
import torch
from moetier.kernels.rmsnorm_rope import rmsnorm, rmsnorm_reference, rope, rope_reference
g = torch.Generator().manual_seed(0)
for shape in [(3, 64), (2, 5, 48), (1, 100)]:
    x = torch.randn(shape, generator=g) * 3
    w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6, True), rmsnorm_reference(x, w, 1e-6),
                               rtol=1e-5, atol=1e-5)
for t, h, d in [(3, 4, 16), (1, 2, 64)]:
    x = torch.randn(t, h, d, generator=g)
    ang = torch.randn(t, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    torch.testing.assert_close(rope(x, cos, sin, True), rope_reference(x, cos, sin),
                               rtol=1e-6, atol=1e-6)
print("ok")
"""


def test_triton_rmsnorm_and_rope_match_reference_in_interpreter() -> None:
    _run_in_interpreter(_NORM_ROPE_CHECK)


def test_launch_shape_by_pairs() -> None:
    pytest.importorskip("triton")
    from moetier.kernels._expert_ffn_triton import (
        LARGE,
        SMALL,
        SMALL_COMPRESSED,
        choose_config,
    )

    assert choose_config(1, 8, 2048, 768) is SMALL
    assert choose_config(8, 8, 2048, 768) is SMALL  # 64 pairs
    assert choose_config(9, 8, 2048, 768) is LARGE
    assert choose_config(8, 8, 2048, 768, compressed=True) is SMALL_COMPRESSED
    assert choose_config(9, 8, 2048, 768, compressed=True) is LARGE
    assert SMALL.split_down and LARGE.split_down and SMALL.up_bn == LARGE.up_bn == 8
