"""Routed experts of one MoE layer for any number of tokens: pairs sorted by slot on the device,
then one grouped GEMM per projection over the sorted blocks, reading the slot pool in place.

Owns the grouped expert kernel's host side (the sort/align of (token, expert) pairs into blocks
of one slot each, launch-shape choice) and its plain-PyTorch reference; knows nothing of which
experts are resident or how they got there (the expert cache owns that).

Semantics, shared by kernel and reference, are kernels/expert_ffn.py's (the experts'
activation and biases of its `ExpertMath`, the model dtype rounding after each op, each token's
terms added in ascending expert order with one rounding per add, or in float32 for topk_sum),
plus two things the wave path needs:
- a pair whose slot is -1 is not part of this call (its expert is in another wave) and adds
  nothing;
- `out`, when given, is where the adds start (the earlier waves' lower experts), else zeros;
  the adds round to its dtype (a topk_sum caller passes float32 and rounds once at the end).
The dot products accumulate in float32 in another order than the slot kernel's (tensor-core
tiles), so a bf16 result may differ from it by an ulp; the parity tests hold either way.

Path: route -> sort pairs by slot (device, no host sync) -> gate/up GEMM + activation per
block -> down GEMM x routing weight per block -> combine per token in ascending expert order.
"""

from __future__ import annotations

import torch

from moetier.kernels.expert_ffn import (
    PLAIN,
    ExpertMath,
    kernel_ok,
    pair_outputs,
    sum_dtype,
    triton_available,
)
from moetier.kernels.slot_layout import SlotLayout

# The crossover on CUDA: a layer call of at most this many (token, expert) pairs runs the slot
# kernel (kernels/expert_ffn.py), a larger one this kernel. Measured on the H200 (one layer call,
# bench/results/2026-12-04-grouped-sweep-h200.md): the slot kernel wins up to 128 pairs (Qwen3
# shape 16 tokens: 212 vs 262 us; DeepSeek 96 pairs: 263 vs 287), the grouped one from 192-256
# (Qwen3 32 tokens: 351 vs 366; DeepSeek 32 tokens: 341 vs 466) and by 5-16x at 64-512 tokens.
SLOT_KERNEL_MAX_PAIRS = 128

# Legend: T tokens, K pairs per token, D hidden, I expert intermediate, S slots, P = T*K pairs,
# BM pairs per block, NB blocks (an upper bound, fixed by P and the layer's expert count).


def grouped_ffn_reference(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    out: torch.Tensor | None = None,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D], pool [S, row] (dense [S, 3ID] unless `layout` says), slots [T, K] int
    (ascending expert per row, -1 = not in this call), weights [T, K], experts [T, K] (their
    ids, read for biases only) -> [T, D] in x.dtype (`out` updated in place when given, in its
    dtype)."""
    valid = slots >= 0  # [T, K]
    y = pair_outputs(x, pool, slots.clamp(min=0), weights, inter, layout, math, experts)
    acc = x.new_zeros(x.shape, dtype=sum_dtype(x.dtype, math)) if out is None else out
    for j in range(slots.shape[1]):
        acc.copy_(torch.where(valid[:, j, None], acc + y[:, j], acc))
    return acc if out is not None else acc.to(x.dtype)


def grouped_ffn_terms(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    max_experts: int,
    experts: torch.Tensor | None = None,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
) -> torch.Tensor:
    """The grouped kernel without its combine: each pair's weighted output y [T, K, D] in
    x.dtype, zero where the slot is -1 (expert parallelism exchanges these terms, then
    `combine_terms` adds them as the kernel's combine does)."""
    if kernel_ok(x) and triton_available():
        from moetier.kernels import _grouped_ffn_triton as tri

        return tri.grouped_ffn_triton(
            x, pool, slots, weights, inter, max_experts, experts=experts, layout=layout,
            math=math, terms=True,
        )  # fmt: skip
    valid = slots >= 0
    y = pair_outputs(x, pool, slots.clamp(min=0), weights, inter, layout, math, experts)
    return torch.where(valid[:, :, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


def combine_terms(terms: torch.Tensor, math: ExpertMath = PLAIN) -> torch.Tensor:
    """terms [T, K, D] (each token's pairs in ascending expert order, x.dtype) -> [T, D]: the
    grouped kernel's combine, each add rounded to the sum dtype (float32 for a topk_sum `math`,
    rounded once at the end)."""
    acc = terms.new_zeros(terms[:, 0].shape, dtype=sum_dtype(terms.dtype, math))
    for j in range(terms.shape[1]):
        acc = acc + terms[:, j]
    return acc.to(terms.dtype)


def align(slots: torch.Tensor, bm: int, max_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by slot into blocks of `bm` pairs of one slot each, on slots' device.

    slots [T, K] (-1 = skip) -> (pairs [NB * bm] int32: each block's pair ids p = t*K + j, P
    where the block is padded; block_slot [NB] int32: each block's slot, -1 for unused blocks).
    NB = ceil((P + min(P, max_experts) * (bm - 1)) / bm) bounds the blocks for any routing, so
    the shapes never depend on the data and nothing here waits for the device.
    """
    flat = slots.reshape(-1).long()  # [P]
    p = flat.numel()
    dev = flat.device
    sorted_slots, order = flat.sort(stable=True)  # [P]: skipped pairs (-1) first
    new = torch.ones(p, dtype=torch.bool, device=dev)
    new[1:] = sorted_slots[1:] != sorted_slots[:-1]
    seg = new.cumsum(0) - 1  # [P] segment (distinct slot) of each sorted pair
    one = torch.ones(p, dtype=torch.long, device=dev)
    count = torch.zeros(p, dtype=torch.long, device=dev).scatter_add_(0, seg, one)  # per segment
    seg_slot = torch.full((p,), -1, dtype=torch.long, device=dev).scatter_(0, seg, sorted_slots)
    start = count.cumsum(0) - count  # first sorted position of each segment
    used = torch.where(seg_slot >= 0, count, 0)
    blocks = (used + bm - 1) // bm
    first_block = blocks.cumsum(0) - blocks
    rank = torch.arange(p, device=dev) - start[seg]
    nb = -(-(p + min(p, max_experts) * (bm - 1)) // bm)
    trash = nb * bm  # skipped pairs land here and are cut off
    dest = torch.where(sorted_slots >= 0, first_block[seg] * bm + rank, trash)
    pairs = torch.full((trash + 1,), p, dtype=torch.int32, device=dev)
    pairs.scatter_(0, dest, order.to(torch.int32))
    slot_at = torch.full((trash + 1,), -1, dtype=torch.int32, device=dev)
    slot_at.scatter_(0, dest, sorted_slots.to(torch.int32))
    return pairs[:trash], slot_at[:trash:bm].contiguous()


def grouped_ffn(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    max_experts: int,
    out: torch.Tensor | None = None,
    experts: torch.Tensor | None = None,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
) -> torch.Tensor:
    """The grouped kernel when Triton and the device allow it, else the reference (same
    contract). `max_experts`: most distinct slots the call can touch (the layer's expert count);
    `experts` [T, K]: the pairs' expert ids (< max_experts), for the kernel's faster align and
    the experts' biases (`math`)."""
    if kernel_ok(x) and triton_available():
        from moetier.kernels import _grouped_ffn_triton as tri

        return tri.grouped_ffn_triton(
            x, pool, slots, weights, inter, max_experts, out, experts=experts, layout=layout,
            math=math,
        )  # fmt: skip
    return grouped_ffn_reference(x, pool, slots, weights, inter, out, layout, math, experts)
