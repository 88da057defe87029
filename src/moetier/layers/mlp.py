"""Dense gated MLP (SwiGLU-style) used for dense layers and shared experts."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
