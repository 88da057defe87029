"""kernels/expert_ffn.py: the reference equals a per-pair loop; the Triton kernel equals the
reference (run by Triton's interpreter on the CPU when Triton is installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetier.kernels.expert_ffn import expert_ffn_reference


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
