"""Llama 4's router: top-1 of the expert logits, its sigmoid the token's score, and the
hand-over that lets MoEBlock compute an expert whose *input* the score scales.

HF's Llama4TextMoe feeds each expert x * score and adds its output unweighted; MoEBlock (and
its kernels) compute weight * expert(x). With one expert per token the two agree exactly when
the block routes first, scales the tokens itself, and the block's gate call then returns that
routing with weight 1.0 (y * 1.0 == y): `hold` arms that for one call. Several experts per
token would need a different input per (token, expert) pair, which MoEBlock cannot take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Legend: T tokens, E experts, D hidden.


class SigmoidTop1Router(nn.Module):
    """Gate of a Llama 4 MoE layer (checkpoint `feed_forward.router.weight`)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self._held: torch.Tensor | None = None

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> expert ids [T, 1] int64, scores [T, 1] in x's dtype (as HF: logits and
        top-1 in the activation dtype, the sigmoid in float32, cast back)."""
        logits = F.linear(x, self.weight)  # [T, E]
        top, ids = torch.topk(logits, 1, dim=-1)  # [T, 1]
        return ids, torch.sigmoid(top.float()).to(top.dtype)

    def hold(self, ids: torch.Tensor | None) -> None:
        """The next call returns `ids` with unit weights (None disarms)."""
        self._held = ids

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> ids [T, 1], weights [T, 1] float32: the held routing with weight 1.0
        inside the block's own call; otherwise (a predictor's lookahead) the routing of x."""
        held, self._held = self._held, None
        if held is not None:
            return held, torch.ones(held.shape, dtype=torch.float32, device=held.device)
        ids, scores = self.scores(x)
        return ids, scores.float()
