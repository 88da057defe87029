"""DeepSeek-V4 routers: learned top-k (scores + correction bias) and hash routing by token id.

Owns the gate weight and, per kind, the `bias` (e_score_correction_bias) or `tid2eid` buffer;
returns expert ids and the weights the routed experts are multiplied by. Mirrors transformers'
DeepseekV4TopKRouter / DeepseekV4HashRouter op for op: scores from the config's scoring
function (sqrtsoftplus for the released models), top-k weights always renormalized, then
scaled by routed_scaling_factor. Hash routing needs the step's token ids: the MoE block passes
them (models/deepseek_v4.py), so its experts are known before the layer runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from moetier.errors import UnsupportedModelError

# Legend: T tokens, E experts, K top-k, D hidden, V vocabulary.


def score_fn(config: Any) -> Any:
    name = str(config.scoring_func)
    if name not in ACT2FN:
        raise UnsupportedModelError(
            f"DeepSeek-V4 scoring_func {name!r} is not a transformers activation; supported: "
            "sqrtsoftplus, sigmoid, softmax"
        )
    return ACT2FN[name]


class _V4Router(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.top_k = int(config.num_experts_per_tok)
        self.scaling = float(config.routed_scaling_factor)
        self.score = score_fn(config)

    def _weights(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w = scores.gather(1, ids)  # [T, K]
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class V4TopKRouter(_V4Router):
    """Top-k of scores + `bias` (chooses only; the weights are the unbiased scores)."""

    bias: torch.Tensor

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # float32 as HF keeps e_score_correction_bias; the loader keeps a buffer's dtype.
        self.register_buffer("bias", torch.empty(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> expert ids [T, K] int64, weights [T, K]."""
        scores = self.score(F.linear(x, self.weight))  # [T, E]
        ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        return ids, self._weights(scores, ids)


class V4HashRouter(_V4Router):
    """Experts fixed per token id (`tid2eid[token]`); the gate only weighs them."""

    tid2eid: torch.Tensor
    # offload/predict.py: gate-lookahead skips this router; HashRoutes reads `tid2eid` to
    # prefetch its experts exactly from the step's token ids
    needs_token_ids = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        shape = (config.vocab_size, self.top_k)
        self.register_buffer("tid2eid", torch.zeros(shape, dtype=torch.long))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], input_ids [T] -> expert ids [T, K] int64, weights [T, K]."""
        if input_ids is None:
            raise UnsupportedModelError(
                "a DeepSeek-V4 hash-routed layer needs the step's token ids; this caller "
                "routes from hidden states only"
            )
        scores = self.score(F.linear(x, self.weight))  # [T, E]
        ids = self.tid2eid[input_ids].long()  # [T, K]
        return ids, self._weights(scores, ids)
