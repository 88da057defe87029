"""RMSNorm matching the HF reference (computed in float32, cast back)."""

from __future__ import annotations

import torch
from torch import nn

from moetier.kernels.rmsnorm_rope import rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # one Triton kernel instead of eager ops (set by the model runner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps, self.fused)


class GemmaRMSNorm(nn.Module):
    """Gemma 4's RMSNorm: x * (mean(x^2) + eps) ** -0.5 and the weight both in float32, then
    cast back; `with_scale=False` has no weight (Gemma 4's v norm and router norm). Not an
    RMSNorm: the fused kernel scales in the activation dtype with rsqrt, which differs here."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class OffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm (Qwen3-Next, Qwen3.5): x * rsqrt(mean(x^2) + eps) * (1 + weight),
    all in float32, then cast back; the stored weight is the offset from 1."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Float32RMSNorm(nn.Module):
    """RMSNorm whose weight stays float32 whatever the model dtype (DeepSeek-V4, where HF keeps
    every norm in float32): normalized in float32, scaled, then cast back to x's dtype."""

    weight: torch.Tensor

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)
