"""Triton kernels behind kernels/expert_ffn.py: a slot-reading grouped GEMV for small batches.

Two launches per MoE layer, no gather copy: `_gate_up_act` computes each (token, expert) pair's
activated intermediate from the slot's gate/up rows; `_down_combine` applies each pair's down
projection and routing weight and adds a token's pairs in ascending expert order, rounding to
the model dtype after each add (see expert_ffn.py for the exact contract). Every weight byte is
read once per pair, so this is meant for decode-sized batches (P pairs up to a few hundred).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Legend: T tokens, K pairs per token, D hidden, I expert intermediate, P = T*K pairs.


@triton.jit
def _gate_up_act(
    x_ptr,
    pool_ptr,
    slot_ptr,
    h_ptr,
    K,
    D,
    NI,
    stride_slot,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    p = tl.program_id(0)
    nb = tl.program_id(1)
    t = p // K
    slot = tl.load(slot_ptr + p).to(tl.int64)
    base = pool_ptr + slot * stride_slot
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rmask = rows < NI
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BK]
        cmask = cols < D
        xv = tl.load(x_ptr + t * D + cols, mask=cmask, other=0.0).to(tl.float32)
        m2 = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        wg = tl.load(base + offs, mask=m2, other=0.0).to(tl.float32)  # [BN, BK]
        wu = tl.load(base + NI * D + offs, mask=m2, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    tl.store(h_ptr + p * NI + rows, (a * u).to(dt), mask=rmask)


@triton.jit
def _down_combine(
    h_ptr,
    pool_ptr,
    slot_ptr,
    w_ptr,
    out_ptr,
    K,
    D,
    NI,
    stride_slot,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    rmask = rows < D
    dt = out_ptr.dtype.element_ty
    out = tl.zeros([BLOCK_N], dtype=tl.float32)  # holds dtype-rounded values
    for j in range(0, K):
        p = t * K + j
        slot = tl.load(slot_ptr + p).to(tl.int64)
        base = pool_ptr + slot * stride_slot + 2 * NI * D
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, NI, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < NI
            hv = tl.load(h_ptr + p * NI + cols, mask=cmask, other=0.0).to(tl.float32)
            m2 = rmask[:, None] & cmask[None, :]
            wd = tl.load(
                base + rows[:, None].to(tl.int64) * NI + cols[None, :], mask=m2, other=0.0
            ).to(tl.float32)  # [BN, BK]
            acc += tl.sum(wd * hv[None, :], axis=1)
        w = tl.load(w_ptr + p).to(tl.float32)
        y = (acc.to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        out = (out + y).to(dt).to(tl.float32)
    tl.store(out_ptr + t * D + rows, out.to(dt), mask=rmask)


def expert_ffn_triton(
    x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, inter: int
) -> torch.Tensor:
    """x [T, D], pool [S, 3ID], slots [T, K] (ascending expert per row), weights [T, K]
    -> [T, D]."""
    t, k = slots.shape
    d = x.shape[1]
    x = x.contiguous()
    slots = slots.to(torch.int32).contiguous()
    weights = weights.contiguous()
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)  # [P, I]
    out = torch.empty_like(x)
    _gate_up_act[(t * k, triton.cdiv(inter, 32))](
        x, pool, slots, h, k, d, inter, pool.stride(0), BLOCK_N=32, BLOCK_K=128
    )
    _down_combine[(t, triton.cdiv(d, 16))](
        h, pool, slots, weights, out, k, d, inter, pool.stride(0), BLOCK_N=16, BLOCK_K=128
    )
    return out
