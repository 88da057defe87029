"""MoE block: router top-k, then routed experts computed with weights from an ExpertProvider.

The block does not know where expert weights live; it asks the provider for the distinct
experts the whole step needs, in waves no larger than the provider can hold at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from moetier.offload.types import ExpertProvider

# Legend: T tokens, E experts, K top-k, D hidden, I expert intermediate.


class SoftmaxTopKRouter(nn.Module):
    """Softmax over expert logits in float32, top-k, optionally renormalized (Mixtral, Qwen)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> expert ids [T, K] int64, weights [T, K] float32."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights


class MoEBlock(nn.Module):
    """Routed experts of one layer. Families subclass it to add shared experts."""

    def __init__(self, layer: int, gate: nn.Module, act: str = "silu") -> None:
        super().__init__()
        self.layer = layer
        self.gate = gate
        self.act = ACT2FN[act]
        self.provider: ExpertProvider | None = None
        self.weights_dtype_cast = False  # cast routing weights to x.dtype before scaling (Qwen2)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, K], [T, K]
        if self.weights_dtype_cast:
            weights = weights.to(x.dtype)
        k = ids.shape[1]
        # The one host sync of this layer: routing ids to the host to know what to fetch.
        flat = ids.flatten().cpu()  # [T*K]
        order = torch.argsort(flat, stable=True)  # token-major slots grouped by expert
        counts = torch.bincount(flat, minlength=1).tolist()
        experts = [e for e, c in enumerate(counts) if c]
        offsets = [0]
        for e in range(len(counts)):
            offsets.append(offsets[-1] + counts[e])
        order_dev = order.to(x.device, non_blocking=True)
        tokens, kpos = order_dev // k, order_dev % k
        out = torch.zeros_like(x)
        provider = self.provider
        assert provider is not None, "expert provider not attached"
        for w0 in range(0, len(experts), provider.max_batch):
            batch = provider.fetch(self.layer, experts[w0 : w0 + provider.max_batch])
            for e, gate_up, down in zip(batch.experts, batch.gate_up, batch.down):
                tok = tokens[offsets[e] : offsets[e + 1]]
                h = F.linear(x[tok], gate_up)  # [n, 2I]
                g, u = h.chunk(2, dim=-1)
                y = F.linear(self.act(g) * u, down)  # [n, D]
                y = y * weights[tok, kpos[offsets[e] : offsets[e + 1]], None]
                out.index_add_(0, tok, y.to(out.dtype))
            provider.release(batch)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x)


def moe_config(config: Any) -> tuple[int, int, int]:
    """(num_experts, top_k, expert intermediate size) from an HF config of any supported family."""
    e = (
        getattr(config, "num_local_experts", None)
        or getattr(config, "num_experts", None)
        or getattr(config, "n_routed_experts", None)
    )
    assert e is not None, "config names no expert count"
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return int(e), int(config.num_experts_per_tok), int(inter)
