"""Gemma 4's router: a weightless RMSNorm, a learned input scale, softmax top-k renormalized,
each weight times its expert's learned `per_expert_scale`; and the hand-over that lets
MoEBlock route on one input and compute the experts on another.

HF's Gemma4TextDecoderLayer routes on the residual stream but feeds the experts
`pre_feedforward_layernorm_2(residual)`; MoEBlock asks its gate about the experts' own input.
The family block routes first, `hold`s the routing, and the block's gate call inside `routed`
returns it. The per-expert scale folds into the routing weight exactly as HF applies it (the
weight, not the output, is scaled), so the block's kernels and loop compute it unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.norm import GemmaRMSNorm

# Legend: T tokens, E experts, K top-k, D hidden.


class Gemma4Router(nn.Module):
    """Checkpoint `layers.{i}.router.{proj.weight, scale, per_expert_scale}`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.norm = GemmaRMSNorm(hidden, eps, with_scale=False)
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.top_k = top_k
        self.root = hidden**-0.5
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The expert logits' weight [E, D] (MoEBlock reads the expert count from it)."""
        return self.proj.weight

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (the residual stream) -> ids [T, K] int64, weights [T, K] float32."""
        h = self.norm(x) * self.scale * self.root
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.per_expert_scale[ids]

    def hold(self, routing: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The next call returns `routing` (None disarms)."""
        self._held = routing

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The held routing inside the block's own call; otherwise (a predictor's lookahead on
        another layer's expert input) the routing of x."""
        held, self._held = self._held, None
        return held if held is not None else self.route(x)
