"""Routed experts of one MoE layer computed straight from the device slot pool, in place.

Owns the slot-reading expert kernels (Triton, CUDA) and their PyTorch reference, and the
vocabulary of what an expert computes around its matrices (`ExpertMath`); knows nothing of
which experts are resident or how they got there (the expert cache owns that).

Semantics, shared by kernel and reference, equal to the per-expert loop in layers/moe.py:
for token t and its K (token, expert) pairs sorted by ascending expert id,
    h   = act(r(gate · x), r(up · x))              rounded to the model dtype after each op
    y_k = r(r(down · h) * w_k)                      w_k the routing weight, product in float32
    out = r(...r(r(0 + y_0) + y_1)... + y_{K-1})   one rounding per add, ascending expert order
so a bf16 model rounds exactly where the loop does (a different order flips near-tied routing
decisions in later layers). Dot products accumulate in float32 in both. `act` (ExpertMath.act,
each op rounded, g = r(gate · x), u = r(up · x)):
    SILU            h = r(r(silu(g)) * u)
    CLAMPED_SWIGLU  g = r(min(g, limit)), u = r(clamp(u, -limit, limit)), then SILU's
                    (DeepSeek-V4's routed experts)
    GPT_OSS_SWIGLU  g, u clamped as above, h = r(r(u + 1) * r(g * r(sigmoid(r(g * alpha)))))
    GELU_TANH       h = r(r(gelu_tanh(g)) * u), gelu_tanh PyTorch's gelu(approximate="tanh")
                    computed in float32 and rounded once (Gemma 4's gelu_pytorch_tanh; no
                    clamp)
with per-expert biases (gpt-oss; indexed by expert id, not slot) added to g and u before the
activation (g = r(g + b_gate), ...) and to the down projection before the routing weight
(y_k = r(r(r(down · h) + b_down) * w_k)). A family whose loop sums each token's K terms at once
(`topk_sum`: DeepSeek-V4, gpt-oss, as transformers' grouped_mm experts do) gets them added in
float32 and rounded once (ascending expert order; the loop's top-k order differs only in
float32 rounding).

Slot layout (kernels/slot_layout.py): one packed row per slot, [gate rows (I x D) | up rows
(I x D) | down (D x I)] in the model dtype, or the same three matrices in a block format (FP8,
GGUF, MXFP4), dequantized in registers and rounded to the model dtype (as the reference
dequantizes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moetier.kernels.slot_layout import SlotLayout

# Legend: T tokens, K pairs per token, D hidden, I expert intermediate, S slots, P = T*K pairs.

# Activation codes (constexpr ACT in the kernels), as the module docstring defines them.
SILU, CLAMPED_SWIGLU, GPT_OSS_SWIGLU, GELU_TANH = 0, 1, 2, 3


@dataclass(frozen=True, eq=False)
class ExpertMath:
    """What a layer's experts compute around their three matrices (module docstring): the
    activation code with its clamp `limit` and sigmoid `alpha`, optional biases by expert id
    (gate [E, I] and up [E, I] sharing any strides, down [E, D] with contiguous rows; all
    three or none) and whether each token's K terms are summed in float32 and rounded once."""

    act: int = SILU
    limit: float = 0.0
    alpha: float = 1.0
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    topk_sum: bool = False


PLAIN = ExpertMath()


def sum_dtype(dtype: torch.dtype, math: ExpertMath | None) -> torch.dtype:
    """The dtype a token's terms are added in: float32 for `topk_sum` (rounded once after)."""
    return torch.float32 if math is not None and math.topk_sum else dtype


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


def activate(
    g: torch.Tensor, u: torch.Tensor, math: ExpertMath, experts: torch.Tensor | None
) -> torch.Tensor:
    """h from the projections g, u [P, I] (model dtype), the ops of each family's loop in its
    order (module docstring); experts [P]: the pairs' expert ids (read for biases only)."""
    if math.biases is not None:
        assert experts is not None, "expert biases need the pairs' expert ids"
        g, u = g + math.biases[0][experts], u + math.biases[1][experts]
    if math.act in (CLAMPED_SWIGLU, GPT_OSS_SWIGLU):
        g, u = g.clamp(max=math.limit), u.clamp(min=-math.limit, max=math.limit)
    if math.act == GPT_OSS_SWIGLU:
        return (u + 1) * (g * torch.sigmoid(g * math.alpha))
    if math.act == GELU_TANH:
        return F.gelu(g, approximate="tanh") * u
    return F.silu(g) * u


def pair_outputs(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each (token, expert) pair's weighted output y [T, K, D] in x.dtype (the rounding of the
    contract above), slots [T, K] >= 0, experts [T, K] their expert ids (read for biases only).
    Shared by the references here and in grouped_ffn.py."""
    ids = None if experts is None else experts.reshape(-1).long()  # [P]
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
    h = activate(g, u, math, ids)
    y = torch.bmm(down, h.unsqueeze(-1)).squeeze(-1)  # [P, D]
    if math.biases is not None:
        y = y + math.biases[2][ids]
    return (y * weights.reshape(-1, 1).float()).to(x.dtype).view(t, k, d)  # [T, K, D]


def expert_ffn_reference(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D], pool [S, row] (dense [S, 3ID] unless `layout` says), slots [T, K] int
    (ascending expert per row), weights [T, K], experts [T, K] (their ids; read for biases
    only) -> [T, D] in x.dtype. The experts compute as `math` says (default: silu-gated)."""
    y = pair_outputs(x, pool, slots, weights, inter, layout, math, experts)  # [T, K, D]
    out = torch.zeros(x.shape, dtype=sum_dtype(x.dtype, math), device=x.device)
    for j in range(slots.shape[1]):
        out += y[:, j]
    return out.to(x.dtype)


def expert_ffn(
    x: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    inter: int,
    layout: SlotLayout | None = None,
    math: ExpertMath = PLAIN,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel when Triton and the device allow it, else the reference (same contract)."""
    if kernel_ok(x):
        return _triton.expert_ffn_triton(
            x, pool, slots, weights, inter, layout=layout, math=math, experts=experts
        )
    return expert_ffn_reference(x, pool, slots, weights, inter, layout, math, experts)


def kernel_ok(x: torch.Tensor) -> bool:
    """A Triton kernel can run on x: CUDA with Triton, or Triton's CPU interpreter (tests)."""
    import os

    return (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and triton_available()
