"""Triton kernels behind kernels/grouped_ffn.py: grouped GEMMs over blocks of pairs of one slot.

Three launches per MoE layer call after the align (grouped_ffn.align), none of which copies an
expert: `_grouped_gate_up` multiplies a block's token rows by its slot's gate and up rows (tensor
cores, float32 accumulation) and stores the activated intermediate per padded row;
`_grouped_down` applies the slot's down projection and each pair's routing weight and stores
y per pair; `_combine_masked` adds each token's pairs in ascending expert order (skipping pairs
of other waves), rounding to the dtype of `out` after each add (the model dtype, or float32 for
a `topk_sum` family, which the caller rounds once). The activation and biases are the slot
kernel's (`activate`, expert_ffn.ExpertMath). Each expert's weights are read once per block of
BM pairs, so this is the path for prefill and large batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moetier.kernels._expert_ffn_triton import activate, bias_args
from moetier.kernels._slot_tiles_triton import weight_tile_kn
from moetier.kernels.expert_ffn import PLAIN, ExpertMath, sum_dtype
from moetier.kernels.grouped_ffn import align
from moetier.kernels.slot_layout import (
    MXFP4,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    SlotLayout,
    chunk_cols,
    dense_layout,
)

# Legend: T tokens, K pairs per token, D hidden, I expert intermediate, P = T*K pairs,
# BM pairs per block, NB blocks.


@triton.jit
def _grouped_gate_up(
    x_ptr,
    pool_ptr,
    pairs_ptr,
    bslot_ptr,
    h_ptr,
    exp_ptr,
    gb_ptr,
    ub_ptr,
    P,
    K,
    D,
    NI,
    stride_slot,
    UP_OFF,
    S_OFF,
    BR,
    B_ROW,
    B_COL,
    LIMIT,
    ALPHA,
    BC: tl.constexpr,
    FMT: tl.constexpr,
    ACT: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(bslot_ptr + b)
    if slot < 0:
        return
    rows_m = b * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded rows of this block
    pair = tl.load(pairs_ptr + rows_m)
    mmask = pair < P
    tok = (pair // K).to(tl.int64)
    rows_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate features
    nmask = rows_n < NI
    base = pool_ptr + slot.to(tl.int64) * stride_slot
    dt = h_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BK]
        cmask = cols < D
        xa = tl.load(
            x_ptr + tok[:, None] * D + cols[None, :],
            mask=mmask[:, None] & cmask[None, :],
            other=0.0,
        )  # [BM, BK]
        # [BK, BN]: weight (n, k)
        wg = weight_tile_kn(base, rows_n, nmask, k0, D, S_OFF, BR, BC, dt, FMT, BLOCK_K)
        wu = weight_tile_kn(base + UP_OFF, rows_n, nmask, k0, D, S_OFF, BR, BC, dt, FMT, BLOCK_K)
        if IEEE:  # float32 operands (an fp32 model, or bf16 upcast for the CPU interpreter)
            xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(xa, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(xa, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(xa, wg, acc_g)
            acc_u = tl.dot(xa, wu, acc_u)
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    bg = 0.0
    bu = 0.0
    if BIAS:  # each row's expert's biases (by expert id; padding rows read none)
        e = tl.load(exp_ptr + pair, mask=mmask, other=0).to(tl.int64)  # [BM]
        boff = e[:, None] * B_ROW + rows_n[None, :] * B_COL  # [BM, BN]
        bmask = mmask[:, None] & nmask[None, :]
        bg = tl.load(gb_ptr + boff, mask=bmask, other=0.0).to(tl.float32)
        bu = tl.load(ub_ptr + boff, mask=bmask, other=0.0).to(tl.float32)
    tl.store(
        h_ptr + rows_m[:, None].to(tl.int64) * NI + rows_n[None, :],
        activate(g, u, bg, bu, LIMIT, ALPHA, dt, ACT, BIAS),
        mask=nmask[None, :],
    )


@triton.jit
def _grouped_down(
    h_ptr,
    pool_ptr,
    pairs_ptr,
    bslot_ptr,
    w_ptr,
    y_ptr,
    exp_ptr,
    db_ptr,
    P,
    D,
    NI,
    stride_slot,
    DOWN_OFF,
    S_OFF,
    BR,
    DB_ROW,
    BC: tl.constexpr,
    FMT: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """y[p] = r(r(down_slot · h_row) * w_p) for the block's pairs, stored at pair p; with
    BIAS, r(r(r(down_slot · h_row) + b_down) * w_p), the bias of the pair's expert id."""
    b = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(bslot_ptr + b)
    if slot < 0:
        return
    rows_m = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows_m)
    mmask = pair < P
    rows_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    nmask = rows_n < D
    base = pool_ptr + slot.to(tl.int64) * stride_slot + DOWN_OFF
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, NI, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < NI
        ha = tl.load(
            h_ptr + rows_m[:, None].to(tl.int64) * NI + cols[None, :],
            mask=cmask[None, :],
            other=0.0,
        )  # [BM, BK]
        # [BK, BN]: down (n, k)
        wd = weight_tile_kn(base, rows_n, nmask, k0, NI, S_OFF, BR, BC, dt, FMT, BLOCK_K)
        if IEEE:
            ha, wd = ha.to(tl.float32), wd.to(tl.float32)
            acc = tl.dot(ha, wd, acc, input_precision="ieee")
        else:
            acc = tl.dot(ha, wd, acc)
    w = tl.load(w_ptr + pair, mask=mmask, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32)
    if BIAS:
        e = tl.load(exp_ptr + pair, mask=mmask, other=0).to(tl.int64)  # [BM]
        bd = tl.load(
            db_ptr + e[:, None] * DB_ROW + rows_n[None, :],
            mask=mmask[:, None] & nmask[None, :],
            other=0.0,
        )  # [BM, BN]
        y = (y + bd.to(tl.float32)).to(dt).to(tl.float32)
    y = (y * w[:, None]).to(dt)
    tl.store(
        y_ptr + pair[:, None].to(tl.int64) * D + rows_n[None, :],
        y,
        mask=mmask[:, None] & nmask[None, :],
    )


@triton.jit
def _combine_masked(y_ptr, slots_ptr, out_ptr, K, D, ACCUM: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = r(...r(r(start + y[t,0]) + y[t,1])... ), r rounding to out's dtype, pairs with
    slot -1 skipped (their y rows were never written: read, then not selected); start = out[t]
    (ACCUM) or 0."""
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    cols = nb * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    dt = out_ptr.dtype.element_ty
    if ACCUM:
        out = tl.load(out_ptr + t * D + cols, mask=m, other=0.0).to(tl.float32)
    else:
        out = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, K):
        valid = tl.load(slots_ptr + t * K + j) >= 0
        y = tl.load(y_ptr + (t * K + j) * D + cols, mask=m, other=0.0).to(tl.float32)
        out = tl.where(valid, (out + y).to(dt).to(tl.float32), out)
    tl.store(out_ptr + t * D + cols, out.to(dt), mask=m)


@triton.jit
def _align_count(experts_ptr, slots_ptr, counts_ptr, slot_of_ptr, P, BLOCK: tl.constexpr):
    """counts[e] = pairs of expert e in this call (slot >= 0); slot_of[e] = its slot."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = p < P
    s = tl.load(slots_ptr + p, mask=m, other=-1)
    e = tl.load(experts_ptr + p, mask=m, other=0)
    valid = m & (s >= 0)
    tl.atomic_add(counts_ptr + e, 1, mask=valid)
    tl.store(slot_of_ptr + e, s, mask=valid)  # every pair of e writes the same slot


@triton.jit
def _align_offsets(counts_ptr, first_ptr, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """first[e] = the first block of expert e: blocks of BM pairs, experts in id order."""
    e = tl.arange(0, BLOCK_E)
    c = tl.load(counts_ptr + e, mask=e < E, other=0)
    blocks = (c + BM - 1) // BM
    tl.store(first_ptr + e, tl.cumsum(blocks, 0) - blocks, mask=e < E)


@triton.jit
def _align_place(
    experts_ptr, slots_ptr, first_ptr, cursor_ptr, pairs_ptr, bslot_ptr, P,
    BM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Each pair takes the next row of its expert's blocks; its block gets the expert's slot.
    Rows within an expert's blocks come in atomic order: a row's result does not depend on
    where it sits (every row is its own dot products)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = p < P
    s = tl.load(slots_ptr + p, mask=m, other=-1)
    e = tl.load(experts_ptr + p, mask=m, other=0)
    valid = m & (s >= 0)
    rank = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
    dest = tl.load(first_ptr + e, mask=valid, other=0) * BM + rank
    tl.store(pairs_ptr + dest, p, mask=valid)
    tl.store(bslot_ptr + dest // BM, s, mask=valid)


def align_triton(
    experts: torch.Tensor, slots: torch.Tensor, bm: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_ffn.align in three launches, binned by expert id (experts [T, K] in [0, E),
    slots [T, K], -1 = skip). Same blocks, same bound on their number; each expert's pairs in
    atomic order within its blocks."""
    p = slots.numel()
    dev = slots.device
    nb = -(-(p + min(p, num_experts) * (bm - 1)) // bm)
    experts = experts.reshape(-1).to(torch.int32).contiguous()
    flat = slots.reshape(-1).contiguous()
    scratch = torch.zeros(3, num_experts, dtype=torch.int32, device=dev)
    counts, cursor, first = scratch[0], scratch[1], scratch[2]
    slot_of = torch.empty(num_experts, dtype=torch.int32, device=dev)
    pairs = torch.full((nb * bm,), p, dtype=torch.int32, device=dev)
    block_slot = torch.full((nb,), -1, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(p, 1024),)
    _align_count[grid](experts, flat, counts, slot_of, p, BLOCK=1024)
    _align_offsets[(1,)](
        counts, first, num_experts, BM=bm, BLOCK_E=triton.next_power_of_2(num_experts)
    )
    _align_place[grid](experts, flat, first, cursor, pairs, block_slot, p, BM=bm, BLOCK=1024)
    return pairs, block_slot


@dataclass(frozen=True)
class GroupedConfig:
    """Launch shape: pairs per block (BM), tile columns x reduction chunk, warps and pipeline
    stages of each GEMM."""

    bm: int = 16
    up_bn: int = 64
    up_bk: int = 64
    up_warps: int = 4
    up_stages: int = 3
    down_bn: int = 64
    down_bk: int = 64
    down_warps: int = 4
    down_stages: int = 3


# Chosen from scripts/gpu_grouped_sweep.py on the H200 (bench/results/2026-12-04-grouped-sweep-
# h200.md), by the mean pairs per touched expert: a short prompt gives each expert a handful of
# pairs (small blocks waste the least padding; one weight pass at ~3 TB/s), a long one hundreds
# (larger tiles reuse each weight tile over more rows: ~200-355 TFLOP/s at 2k-8k tokens).
CONFIGS: list[tuple[float, GroupedConfig]] = [
    (12.0, GroupedConfig(16, 64, 128, 4, 4, 64, 128, 4, 4)),
    (28.0, GroupedConfig(32, 64, 64, 4, 3, 64, 64, 4, 3)),
    (64.0, GroupedConfig(64, 64, 64, 4, 3, 64, 64, 4, 3)),
    (160.0, GroupedConfig(64, 128, 64, 4, 4, 128, 64, 4, 4)),
    (float("inf"), GroupedConfig(128, 128, 64, 8, 3, 128, 64, 8, 3)),
]


def choose_config(pairs: int, max_experts: int) -> GroupedConfig:
    """The launch shape for a call of `pairs` (token, expert) pairs over at most `max_experts`
    slots, by the mean pairs an expert gets (known on the host without a sync)."""
    mean = pairs / max(1, min(pairs, max_experts))
    for limit, cfg in CONFIGS:
        if mean <= limit:
            return cfg
    return CONFIGS[-1][1]


def _tile(bk: int, fmt: int, layout: SlotLayout) -> int:
    """BLOCK_K of one GEMM for its weights' format (`weight_tile_kn`): a GGUF sub-block of 32
    columns (MXFP4's block too), an FP8 chunk inside one scale block (a power-of-two block),
    else `bk`."""
    if fmt in (Q8_0, Q4_K, Q5_K, Q6_K, MXFP4):
        return 32
    return chunk_cols(bk, fmt, layout)


def grouped_ffn_triton(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    max_experts: int,
    out: torch.Tensor | None = None,
    cfg: GroupedConfig | None = None,
    experts: torch.Tensor | None = None,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
    terms: bool = False,
) -> torch.Tensor:
    """`terms`: return each pair's weighted output [T, K, D] (zero where the slot is -1)
    instead of combining them (`grouped_ffn_terms`).

    x [T, D], pool [S, row] (rows as `layout` says; default dense [S, 3ID]), slots [T, K]
    (ascending expert per row, -1 = skip), weights [T, K] -> [T, D] (`out` updated in place
    when given, in its dtype: float32 for a topk_sum `math`). `experts` [T, K] (the pairs'
    expert ids, < max_experts; needed by biases): the align runs as three Triton launches
    binned by them, else as PyTorch ops sorting the slots."""
    t, k = slots.shape
    d = x.shape[1]
    p = t * k
    x = x.contiguous()
    slots = slots.to(torch.int32).contiguous()
    weights = weights.reshape(-1).contiguous()
    cfg = cfg or choose_config(p, max_experts)
    if terms and p == 0:
        return x.new_zeros(t, k, d)
    accum = out is not None
    if out is None and not terms:
        out = torch.empty(x.shape, dtype=sum_dtype(x.dtype, math), device=x.device)
    if p == 0:
        assert out is not None
        return out.zero_().to(x.dtype) if not accum else out
    if experts is not None:
        pairs, block_slot = align_triton(experts, slots, cfg.bm, max_experts)  # [NB*BM], [NB]
    else:
        pairs, block_slot = align(slots, cfg.bm, max_experts)
    nb = block_slot.numel()
    # fp32 models keep fp32 products (no TF32); Triton's CPU interpreter gets bf16 dots wrong,
    # so there the operands are upcast (bf16 products are exact in fp32 either way)
    ieee = x.dtype == torch.float32 or not x.is_cuda
    layout = layout or dense_layout(d, inter)
    scales = (layout.scales, layout.block[0])
    bias = math.biases is not None
    exp, gb, ub, db, b_row, b_col, db_row = bias_args(math, experts, slots)
    up_bk = _tile(cfg.up_bk, layout.gate_up_format, layout)
    h = torch.empty(nb * cfg.bm, inter, dtype=x.dtype, device=x.device)  # [NB*BM, I]
    _grouped_gate_up[(nb, triton.cdiv(inter, cfg.up_bn))](
        x, pool, pairs, block_slot, h, exp, gb, ub, p, k, d, inter, pool.stride(0), layout.up,
        *scales, b_row, b_col, math.limit, math.alpha,
        BC=layout.block[1], FMT=layout.gate_up_format, ACT=math.act, BIAS=bias,
        BLOCK_M=cfg.bm, BLOCK_N=cfg.up_bn, BLOCK_K=up_bk, IEEE=ieee,
        num_warps=cfg.up_warps, num_stages=cfg.up_stages,
    )  # fmt: skip
    down_bk = _tile(cfg.down_bk, layout.down_format, layout)
    # [P, D]; skipped pairs' rows are never written (zeroed first when they are the result)
    y = (torch.zeros if terms else torch.empty)(p, d, dtype=x.dtype, device=x.device)
    _grouped_down[(nb, triton.cdiv(d, cfg.down_bn))](
        h, pool, pairs, block_slot, weights, y, exp, db, p, d, inter, pool.stride(0),
        layout.down, *scales, db_row,
        BC=layout.block[1], FMT=layout.down_format, BIAS=bias,
        BLOCK_M=cfg.bm, BLOCK_N=cfg.down_bn, BLOCK_K=down_bk, IEEE=ieee,
        num_warps=cfg.down_warps, num_stages=cfg.down_stages,
    )  # fmt: skip
    if terms:
        return y.view(t, k, d)
    assert out is not None
    _combine_masked[(t, triton.cdiv(d, 512))](y, slots, out, k, d, ACCUM=accum, BLOCK=512)
    return out if accum else out.to(x.dtype)
