"""DeepSeek routers: softmax or sigmoid expert scores with (group-limited) top-k selection.

Owns the gate weight and, for V3, the `e_score_correction_bias` buffer; returns the expert ids
and the weights the routed experts are multiplied by. Mirrors transformers' DeepseekV2TopkRouter
and DeepseekV3TopkRouter operation for operation (float32 throughout, as HF computes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import UnsupportedModelError

# Legend: T tokens, E experts, G groups, K top-k.

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class DeepseekRouter(nn.Module):
    """Top-k router of DeepSeek MoE layers.

    score_func "softmax" (V2) or "sigmoid" (V3). topk_method:
      - "greedy": plain top-k of the scores;
      - "group_limited_greedy" (V2): keep the `topk_group` groups with the highest max score,
        zero the other groups' scores, then top-k;
      - "noaux_tc" (V3): choose with scores + e_score_correction_bias; a group scores the sum of
        its two best biased scores; other groups are masked to -inf; weights are the unbiased
        scores of the chosen experts.
    normalize renormalizes the top-k weights (V3's norm_topk_prob); `scaling` always multiplies
    them afterwards (HF's V2 router scales unconditionally and has no renormalization).
    """

    weight: torch.Tensor
    e_score_correction_bias: torch.Tensor

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        score_func: str,
        topk_method: str,
        n_group: int | None = None,
        topk_group: int | None = None,
        normalize: bool = False,
        scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if score_func not in ("softmax", "sigmoid") or topk_method not in TOPK_METHODS:
            raise UnsupportedModelError(
                f"DeepSeek router with scoring {score_func!r} and topk_method {topk_method!r} is "
                f"not supported (supported: softmax/sigmoid with {', '.join(TOPK_METHODS)})"
            )
        if topk_method != "greedy" and not (n_group and topk_group):
            raise UnsupportedModelError(f"topk_method {topk_method!r} needs n_group and topk_group")
        # A float32 buffer, not a parameter: the loader keeps a buffer's declared dtype, which is
        # what HF's _keep_in_fp32_modules_strict ("gate.weight") does in bf16/fp16 runs.
        self.register_buffer("weight", torch.empty(num_experts, hidden, dtype=torch.float32))
        if topk_method == "noaux_tc":
            bias = torch.empty(num_experts, dtype=torch.float32)
            self.register_buffer("e_score_correction_bias", bias)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.topk_method = score_func, topk_method
        self.n_group, self.topk_group = n_group or 1, topk_group or 1
        self.normalize, self.scaling = normalize, scaling

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """group_scores [T, G] -> bool mask [T, E] of experts inside the top `topk_group` groups."""
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]  # [T, g]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        per_group = self.num_experts // self.n_group
        mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group)  # [T, G, E/G]
        return mask.reshape(-1, self.num_experts).bool()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> expert ids [T, K] int64, weights [T, K] float32."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = logits.sigmoid()
        grouped = (-1, self.n_group, self.num_experts // self.n_group)
        if self.topk_method == "greedy":
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)  # [T, K]
        elif self.topk_method == "group_limited_greedy":
            mask = self._group_mask(scores.view(grouped).max(dim=-1).values)  # [T, E]
            masked = scores.masked_fill(~mask, 0.0)
            weights, ids = torch.topk(masked, k=self.top_k, dim=-1, sorted=False)
        else:
            # The correction bias steers which experts are chosen, never how much they weigh.
            choice = scores + self.e_score_correction_bias  # [T, E]
            group_scores = choice.view(grouped).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, K]
            weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling
