"""Triton kernels behind kernels/expert_ffn.py: a slot-reading grouped GEMV for small batches.

Two launches per MoE layer, no gather copy: `_gate_up_act` computes each (token, expert) pair's
activated intermediate from the slot's gate/up rows; `_down_combine` applies each pair's down
projection and routing weight and adds a token's pairs in ascending expert order, rounding to
the model dtype after each add (see expert_ffn.py for the exact contract). Every weight byte is
read once per pair, so this is meant for decode-sized batches (P pairs up to a few hundred).
`activate` (the activation codes and biases of expert_ffn.ExpertMath) is shared with the grouped
kernel. A token's terms are added in the dtype of `out`: the model dtype, or float32 for a
`topk_sum` family (the caller rounds once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moetier.kernels._slot_tiles_triton import dot_chunk
from moetier.kernels.expert_ffn import PLAIN, ExpertMath, sum_dtype
from moetier.kernels.slot_layout import SlotLayout, chunk_cols, dense_layout

# Legend: T tokens, K pairs per token, D hidden, I expert intermediate, P = T*K pairs.


# Triton's CPU interpreter (tests) has no libdevice: `tanh_f32` computes there in float64 and
# rounds (read at import, as the interpreter itself is).
_INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def tanh_f32(x):
    """tanh of float32 x: CUDA's tanhf (libdevice), as PyTorch's CUDA gelu kernel calls it; in
    the interpreter float64's, rounded to float32 (within an ulp of the CPU's tanh)."""
    if _INTERPRET:
        y = tl.minimum(tl.maximum(x, -20.0), 20.0).to(tl.float64)  # tanh(+-20) = +-1 in fp32
        e = tl.exp(2.0 * y)
        t = ((e - 1.0) / (e + 1.0)).to(tl.float32)
    else:
        t = libdevice.tanh(x)
    return t


@triton.jit
def gelu_tanh(g):
    """PyTorch's gelu(approximate="tanh") of float32 g in float32, its ops in its order
    (aten ActivationGeluKernel.cu: kBeta = sqrt(2) * 2/sqrt(pi) / 2, kKappa = 0.044715; the
    add after kKappa's product fused as nvcc fuses it): bit-equal to torch's on CUDA for every
    bf16 and fp16 value (tests/gpu/test_gpu_activations.py, H100)."""
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    return (0.5 * g) * (1.0 + tanh_f32(inner))


@triton.jit
def activate(g, u, bg, bu, LIMIT, ALPHA, dt: tl.constexpr, ACT: tl.constexpr,
             BIAS: tl.constexpr):  # fmt: skip
    """h in dt from g, u (float32 holding values already rounded to dt; any shape) and the
    biases bg, bu (float32, read when BIAS), each op rounded to dt as the family's per-expert
    loop rounds it (expert_ffn.py `activate`; ACT: its activation codes)."""
    if BIAS:
        g = (g + bg).to(dt).to(tl.float32)
        u = (u + bu).to(dt).to(tl.float32)
    if ACT == 1 or ACT == 2:  # the clamped SwiGLUs: gate <= limit, |up| <= limit
        g = tl.minimum(g, LIMIT).to(dt).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT).to(dt).to(tl.float32)
    if ACT == 2:  # gpt-oss: (up + 1) * (g * sigmoid(alpha * g))
        s = tl.sigmoid((g * ALPHA).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        glu = (g * s).to(dt).to(tl.float32)
        h = ((u + 1.0).to(dt).to(tl.float32) * glu).to(dt)
    elif ACT == 3:  # Gemma 4: gelu_pytorch_tanh(g) * up
        a = gelu_tanh(g).to(dt).to(tl.float32)
        h = (a * u).to(dt)
    else:
        a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        h = (a * u).to(dt)
    return h


@triton.jit
def _gate_up_act(
    x_ptr,
    pool_ptr,
    slot_ptr,
    h_ptr,
    exp_ptr,
    gb_ptr,
    ub_ptr,
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WARPS: tl.constexpr,
):
    p = tl.program_id(0)
    nb = tl.program_id(1)
    t = p // K
    dt = h_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + p).to(tl.int64)
    base = pool_ptr + slot * stride_slot
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rmask = rows < NI
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_row = x_ptr + t * D
    for k0 in range(0, D, BLOCK_K):
        acc_g += dot_chunk(base, rows, rmask, x_row, k0, D, S_OFF, BR, BC, dt, FMT, BLOCK_K,
                           WARPS)  # fmt: skip
        acc_u += dot_chunk(base + UP_OFF, rows, rmask, x_row, k0, D, S_OFF, BR, BC, dt, FMT,
                           BLOCK_K, WARPS)  # fmt: skip
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    bg = 0.0
    bu = 0.0
    if BIAS:  # the pair's expert's biases (by expert id, not slot)
        boff = tl.load(exp_ptr + p).to(tl.int64) * B_ROW + rows * B_COL
        bg = tl.load(gb_ptr + boff, mask=rmask, other=0.0).to(tl.float32)
        bu = tl.load(ub_ptr + boff, mask=rmask, other=0.0).to(tl.float32)
    h = activate(g, u, bg, bu, LIMIT, ALPHA, dt, ACT, BIAS)
    tl.store(h_ptr + p * NI + rows, h, mask=rmask)


@triton.jit
def _down_combine(
    h_ptr,
    pool_ptr,
    slot_ptr,
    w_ptr,
    out_ptr,
    exp_ptr,
    db_ptr,
    K,
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WARPS: tl.constexpr,
):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    rmask = rows < D
    dt = h_ptr.dtype.element_ty
    odt = out_ptr.dtype.element_ty  # the sum's rounding: dt, or float32 (topk_sum)
    out = tl.zeros([BLOCK_N], dtype=tl.float32)  # holds odt-rounded values
    for j in range(0, K):
        p = t * K + j
        slot = tl.load(slot_ptr + p).to(tl.int64)
        base = pool_ptr + slot * stride_slot + DOWN_OFF
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, NI, BLOCK_K):
            acc += dot_chunk(base, rows, rmask, h_ptr + p * NI, k0, NI, S_OFF, BR, BC, dt, FMT,
                             BLOCK_K, WARPS)  # fmt: skip
        y = _bias_weight(acc, w_ptr, exp_ptr, db_ptr, p, rows, rmask, DB_ROW, dt, BIAS)
        out = (out + y.to(tl.float32)).to(odt).to(tl.float32)
    tl.store(out_ptr + t * D + rows, out.to(odt), mask=rmask)


@triton.jit
def _bias_weight(acc, w_ptr, exp_ptr, db_ptr, p, rows, rmask, DB_ROW, dt: tl.constexpr,
                 BIAS: tl.constexpr):  # fmt: skip
    """Pair p's term in dt from its down projection acc (float32): r(r(r(acc) + b_down) * w_p),
    the bias (by the pair's expert id) when BIAS."""
    y = acc.to(dt).to(tl.float32)
    if BIAS:
        e = tl.load(exp_ptr + p).to(tl.int64)
        b = tl.load(db_ptr + e * DB_ROW + rows, mask=rmask, other=0.0).to(tl.float32)
        y = (y + b).to(dt).to(tl.float32)
    return (y * tl.load(w_ptr + p).to(tl.float32)).to(dt)


@triton.jit
def _down_pair(
    h_ptr,
    pool_ptr,
    slot_ptr,
    w_ptr,
    y_ptr,
    exp_ptr,
    db_ptr,
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WARPS: tl.constexpr,
):
    """One (token, expert) pair's weighted down projection, pairs in parallel: y[p] =
    r(r(down_p · h_p) * w_p) (with its down bias, `_bias_weight`). `_combine` adds a token's
    pairs in order afterwards."""
    p = tl.program_id(0)
    nb = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < D
    dt = y_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + p).to(tl.int64)
    base = pool_ptr + slot * stride_slot + DOWN_OFF
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, NI, BLOCK_K):
        acc += dot_chunk(base, rows, rmask, h_ptr + p * NI, k0, NI, S_OFF, BR, BC, dt, FMT,
                         BLOCK_K, WARPS)  # fmt: skip
    y = _bias_weight(acc, w_ptr, exp_ptr, db_ptr, p, rows, rmask, DB_ROW, dt, BIAS)
    tl.store(y_ptr + p * D + rows, y, mask=rmask)


@triton.jit
def _combine(y_ptr, out_ptr, K, D, BLOCK: tl.constexpr):
    """out[t] = r(...r(r(0 + y[t,0]) + y[t,1])... + y[t,K-1]), ascending expert order, r
    rounding to out's dtype (float32 for a topk_sum family: no rounding)."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    cols = nb * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    dt = out_ptr.dtype.element_ty
    out = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, K):
        y = tl.load(y_ptr + (t * K + j) * D + cols, mask=m, other=0.0).to(tl.float32)
        out = (out + y).to(dt).to(tl.float32)
    tl.store(out_ptr + t * D + cols, out.to(dt), mask=m)


@dataclass(frozen=True)
class FfnConfig:
    """Launch shape of the two halves: tile rows x reduction chunk, warps, pipeline stages.
    `split_down`: the down projection runs one program per (pair, row block) and a small
    `_combine` adds each token's pairs; else `_down_combine` walks a token's pairs in turn."""

    up_bn: int = 32
    up_bk: int = 128
    up_warps: int = 4
    up_stages: int = 3
    split_down: bool = False
    down_bn: int = 16
    down_bk: int = 128
    down_warps: int = 4
    down_stages: int = 3


LEGACY = FfnConfig()


# Chosen from scripts/gpu_ffn_sweep.py on the H200 (bench/results/2026-12-03-ffn-sweep-h200.md):
# 8-row tiles give the most programs (memory parallelism) for GEMV-sized calls, and the split
# down projection runs a token's pairs in parallel instead of one after the other. At T=1 this
# moved gate/up from 1.1-1.5 to 3.6-4.2 TB/s and down from 1.0 to 3.4-3.6 TB/s.
SMALL = FfnConfig(8, 256, 8, 1, True, 8, 256, 4, 1)  # up to 64 pairs (decode, batch <= 8)
LARGE = FfnConfig(8, 128, 4, 1, True, 16, 128, 4, 1)
# Compressed slots (FP8, GGUF) at up to 64 pairs, from scripts/gpu_formats.py's sweeps on the
# H100 (bench/results/2026-12-06-formats-h100.md): 4-row tiles, one warp and two pipeline
# stages (the next chunk's loads in flight while one decodes) at T = 1: Q4_K 48.5 -> 27.1 us,
# Q4_K_M 51.7 -> 31.1, Q8_0 61.9 -> 38.6, Q6_K 54.8 -> 39.8, FP8 30.6 -> 27.4 against SMALL.
SMALL_COMPRESSED = FfnConfig(4, 256, 1, 2, True, 4, 256, 1, 2)


def choose_config(t: int, k: int, d: int, inter: int, compressed: bool = False) -> FfnConfig:
    """The launch shape for a layer call of T tokens x K pairs (D hidden, I intermediate) on
    dense or compressed slots."""
    if t * k <= 64:
        return SMALL_COMPRESSED if compressed else SMALL
    return LARGE


def gate_up(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    h: torch.Tensor,
    k: int,
    inter: int,
    cfg: FfnConfig,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
    experts: torch.Tensor | None = None,
) -> None:
    d = x.shape[1]
    layout = layout or dense_layout(d, inter)
    bk = chunk_cols(cfg.up_bk, layout.gate_up_format, layout)
    exp, gb, ub, _, b_row, b_col, _ = bias_args(math, experts, slots)
    _gate_up_act[(slots.numel(), triton.cdiv(inter, cfg.up_bn))](
        x, pool, slots, h, exp, gb, ub, k, d, inter, pool.stride(0), layout.up,
        *_scale_args(layout), b_row, b_col, math.limit, math.alpha,
        BC=layout.block[1], FMT=layout.gate_up_format, ACT=math.act,
        BIAS=math.biases is not None, BLOCK_N=cfg.up_bn, BLOCK_K=bk, WARPS=cfg.up_warps,
        num_warps=cfg.up_warps, num_stages=cfg.up_stages,
    )  # fmt: skip


def bias_args(
    math: ExpertMath, experts: torch.Tensor | None, placeholder: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """(expert ids [P] int32, gate, up and down bias, gate/up row and column strides, down row
    stride) for a launch; `placeholder` (never read) where `math` has no biases."""
    if math.biases is None:
        return placeholder, placeholder, placeholder, placeholder, 0, 0, 0
    assert experts is not None, "expert biases need the pairs' expert ids"
    gb, ub, db = math.biases
    assert gb.stride() == ub.stride() and db.stride(1) == 1
    exp = experts.reshape(-1).to(torch.int32).contiguous()
    return exp, gb, ub, db, gb.stride(0), gb.stride(1), db.stride(0)


def down(
    h: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    inter: int,
    cfg: FfnConfig,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
    experts: torch.Tensor | None = None,
) -> None:
    """out [T, D] (h's dtype, or float32 for the unrounded topk_sum) = each token's terms."""
    t, k = slots.shape
    d = out.shape[1]
    layout = layout or dense_layout(d, inter)
    bk = chunk_cols(cfg.down_bk, layout.down_format, layout)
    exp, _, _, db, _, _, db_row = bias_args(math, experts, slots)
    tile = dict(
        BC=layout.block[1], FMT=layout.down_format, BIAS=math.biases is not None,
        BLOCK_N=cfg.down_bn, BLOCK_K=bk, WARPS=cfg.down_warps, num_warps=cfg.down_warps,
        num_stages=cfg.down_stages,
    )  # fmt: skip
    rows = triton.cdiv(d, cfg.down_bn)
    at = (pool.stride(0), layout.down, *_scale_args(layout), db_row)
    if cfg.split_down:
        y = torch.empty(t * k, d, dtype=h.dtype, device=out.device)  # [P, D]
        _down_pair[(t * k, rows)](h, pool, slots, weights, y, exp, db, d, inter, *at, **tile)
        _combine[(t, triton.cdiv(d, 512))](y, out, k, d, BLOCK=512, num_warps=4)
    else:
        _down_combine[(t, rows)](h, pool, slots, weights, out, exp, db, k, d, inter, *at, **tile)


def _scale_args(layout: SlotLayout) -> tuple[int, int]:
    """S_OFF, BR of a layout (FP8's scales; placeholders otherwise, never read); BC goes by
    name (a constexpr after the runtime arguments)."""
    return layout.scales, layout.block[0]


def expert_ffn_triton(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    cfg: FfnConfig | None = None,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D], pool [S, row] (rows as `layout` says; default dense [S, 3ID]), slots [T, K]
    (ascending expert per row), weights [T, K], experts [T, K] (their ids, read for biases
    only) -> [T, D]; the experts compute as `math` says (expert_ffn.py)."""
    t, k = slots.shape
    x = x.contiguous()
    slots = slots.to(torch.int32).contiguous()
    weights = weights.contiguous()
    layout = layout or dense_layout(x.shape[1], inter)
    cfg = cfg or choose_config(t, k, x.shape[1], inter, layout.compressed)
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)  # [P, I]
    out = torch.empty(x.shape, dtype=sum_dtype(x.dtype, math), device=x.device)
    gate_up(x, pool, slots, h, k, inter, cfg, layout, math, experts)
    down(h, pool, slots, weights, out, inter, cfg, layout, math, experts)
    return out.to(x.dtype)
