"""The decoder skeleton every family builds from layers/, with HF-matching module names.

A family supplies per-layer attention and MLP modules; this module owns the embedding, the
layer loop, the final norm and the LM head. Module names equal the checkpoint's tensor names
so non-expert weights load by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from moetier.layers.context import ForwardContext
from moetier.layers.moe import MoEBlock
from moetier.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP or MoE (named as in the checkpoint)."""

    def __init__(
        self, config: Any, self_attn: nn.Module, mlp: nn.Module, mlp_name: str = "mlp"
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + getattr(self, self.mlp_name)(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: Any, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """model.{embed_tokens, layers, norm} + lm_head, over a flattened batch of T tokens."""

    def __init__(self, config: Any, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, D]."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] in float32."""
        return self.lm_head(hidden).float()

    def moe_blocks(self) -> list[MoEBlock]:
        return [m for m in self.modules() if isinstance(m, MoEBlock)]
