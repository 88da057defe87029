"""Routed experts of one MoE layer computed straight from the device slot pool, in place.

Owns the slot-reading expert kernels (Triton, CUDA) and their PyTorch reference; knows nothing
of which experts are resident or how they got there (the expert cache owns that).

Semantics, shared by kernel and reference, equal to the per-expert loop in layers/moe.py:
for token t and its K (token, expert) pairs sorted by ascending expert id,
    h   = act(r(gate · x)) * r(up · x)             rounded to the model dtype after each op
    y_k = r(r(down · h) * w_k)                      w_k the routing weight, product in float32
    out = r(...r(r(0 + y_0) + y_1)... + y_{K-1})   one rounding per add, ascending expert order
so a bf16 model rounds exactly where the loop does (a different order flips near-tied routing
decisions in later layers). Dot products accumulate in float32 in both.

Slot layout (kernels/slot_layout.py): one packed row per slot, [gate rows (I x D) | up rows
(I x D) | down (D x I)] in the model dtype, or the same three matrices in FP8 with block scales,
dequantized in registers and rounded to the model dtype (as the reference dequantizes them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moetier.kernels.slot_layout import SlotLayout

# Legend: T tokens, K pairs per token, D hidden, I expert intermediate, S slots, P = T*K pairs.

_triton: Any = None


def triton_available() -> bool:
    """True when Triton imports (the kernel path needs it; the reference never does)."""
    global _triton
    if _triton is None:
        try:
            from moetier.kernels import _expert_ffn_triton as mod

            _triton = mod
        except ImportError:
            _triton = False
    return bool(_triton)


def densify(
    pool: torch.Tensor, slots: torch.Tensor, layout: SlotLayout | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool, slots) as dense rows: unchanged for a dense layout; else the slots' experts
    decoded into a new [N, 3ID] pool and the slots renumbered into it (references only)."""
    if layout is None or layout.split is None:
        return pool, slots
    used, index = torch.unique(slots.clamp(min=0), return_inverse=True)
    rows = []
    for s in used.tolist():
        gate_up, down = layout.split(pool[s])
        rows.append(torch.cat([gate_up.flatten(), down.flatten()]))
    return torch.stack(rows), torch.where(slots >= 0, index, slots)


def pair_outputs(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    layout: SlotLayout | None = None,
) -> torch.Tensor:
    """Each (token, expert) pair's weighted output y [T, K, D] in x.dtype (the rounding of the
    contract above), slots [T, K] >= 0. Shared by the references here and in grouped_ffn.py."""
    pool, slots = densify(pool, slots, layout)
    t, k = slots.shape
    d = x.shape[1]
    w = pool.index_select(0, slots.reshape(-1).long())  # [P, 3ID]
    gate = w[:, : inter * d].view(-1, inter, d)  # [P, I, D]
    up = w[:, inter * d : 2 * inter * d].view(-1, inter, d)  # [P, I, D]
    down = w[:, 2 * inter * d :].view(-1, d, inter)  # [P, D, I]
    xp = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [P, D, 1]
    g = torch.bmm(gate, xp).squeeze(-1)  # [P, I]
    u = torch.bmm(up, xp).squeeze(-1)
    h = F.silu(g) * u
    y = torch.bmm(down, h.unsqueeze(-1)).squeeze(-1)  # [P, D]
    return (y * weights.reshape(-1, 1).float()).to(x.dtype).view(t, k, d)  # [T, K, D]


def expert_ffn_reference(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    layout: SlotLayout | None = None,
) -> torch.Tensor:
    """x [T, D], pool [S, row] (dense [S, 3ID] unless `layout` says), slots [T, K] int
    (ascending expert per row), weights [T, K] -> [T, D] in x.dtype. Silu-gated experts."""
    y = pair_outputs(x, pool, slots, weights, inter, layout)  # [T, K, D]
    out = torch.zeros_like(x)
    for j in range(slots.shape[1]):
        out += y[:, j]
    return out


def expert_ffn(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    layout: SlotLayout | None = None,
) -> torch.Tensor:
    """The kernel when Triton and the device allow it, else the reference (same contract)."""
    if kernel_ok(x):
        return _triton.expert_ffn_triton(x, pool, slots, weights, inter, layout=layout)
    return expert_ffn_reference(x, pool, slots, weights, inter, layout)


def kernel_ok(x: torch.Tensor) -> bool:
    """A Triton kernel can run on x: CUDA with Triton, or Triton's CPU interpreter (tests)."""
    import os

    return (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and triton_available()
