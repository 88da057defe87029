"""DeepSeek-V4 (DeepseekV4ForCausalLM): hyper-connected residual streams (layers/
hyper_connection.py), attention over a sliding window plus compressed KV entries
(layers/compressed_attention.py), and every layer MoE: hash-routed first layers (experts =
`tid2eid[token]`), learned top-k after (layers/deepseek_v4_router.py), a shared expert, and
SwiGLU clamped at swiglu_limit in routed and shared experts alike.

Module names are the checkpoint's as transformers saves it (`model.layers.{i}.attn.wq_a`,
`ffn.experts.{e}.w1`, `hc_attn_fn`, `head.weight`, ...). The hash routers need the step's token
ids: the model hands them to each MoE block beside the hidden states. Routed experts go through
MoEBlock and the expert tiers like every family's; the expert kernels compute their clamped
SwiGLU (kernels/expert_ffn.py CLAMPED_SWIGLU). No CUDA graphs: the attention sizes each
sequence's history and compressed entries from host lengths, which a graph would fix
(`Family.no_graphs`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from moetier.errors import UnsupportedModelError
from moetier.kernels.expert_ffn import CLAMPED_SWIGLU, ExpertMath
from moetier.layers.compressed_attention import LAYER_KINDS, CompressedAttention
from moetier.layers.context import ForwardContext
from moetier.layers.deepseek_v4_router import V4HashRouter, V4TopKRouter
from moetier.layers.hyper_connection import HyperConnection, HyperHead, expand
from moetier.layers.moe import MoEBlock, moe_config
from moetier.layers.norm import Float32RMSNorm
from moetier.models.base import CausalLM
from moetier.models.registry import Family, register

# Legend: T tokens, N residual streams (hc_mult), D hidden, I expert intermediate, n rows.

MLP_KINDS = ("hash_moe", "moe")


class ClampedMLP(nn.Module):
    """The shared expert (`shared_experts.w1/w2/w3`): SwiGLU with gate <= limit, |up| <= limit."""

    def __init__(self, hidden: int, inter: int, act: str, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.act, self.limit = ACT2FN[act], limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        return self.w2(self.act(gate) * self.w3(x).clamp(min=-self.limit, max=self.limit))


class V4MoE(MoEBlock):
    """Routed experts (hash or top-k routed) plus the shared expert, summed as in HF. Each
    token's K expert outputs are summed at once, as transformers' grouped_mm experts do; the
    expert kernels compute the clamped SwiGLU and that sum (`expert_math`)."""

    def __init__(self, config: Any, layer: int, hashed: bool) -> None:
        gate = V4HashRouter(config) if hashed else V4TopKRouter(config)
        super().__init__(layer, gate, config.hidden_act)
        _, _, inter = moe_config(config)
        self.hashed, self.limit = hashed, float(config.swiglu_limit)
        self.shared_experts = ClampedMLP(config.hidden_size, inter, config.hidden_act, self.limit)
        self.topk_sum = True
        self.act_name = "clamped_silu"
        # the kernels clamp before silu; any other gate activation takes the per-expert loop
        self.kernel_act = CLAMPED_SWIGLU if config.hidden_act == "silu" else None

    def expert_math(self) -> ExpertMath:
        assert self.kernel_act is not None, "the expert kernels do not compute this block"
        return ExpertMath(self.kernel_act, self.limit, topk_sum=self.topk_sum)

    def expert_mlp(
        self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert: int
    ) -> torch.Tensor:
        """x [n, D], gate_up [2I, D] (w1 rows, then w3 rows), down [D, I] -> [n, D]."""
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)  # [n, I] each
        g, u = g.clamp(max=self.limit), u.clamp(min=-self.limit, max=self.limit)
        return F.linear(self.act(g) * u, down)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D], input_ids [T] (read by hash routers only, which raise without them) ->
        [T, D]."""
        routed = (
            self.routed(x, input_ids) if self.hashed and input_ids is not None else self.routed(x)
        )
        return routed + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    """Attention then MoE, each between a hyper-connection collapse and expansion of the N
    residual streams; the mHC weights are float32 buffers named as on disk."""

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        d, eps, n = config.hidden_size, config.rms_norm_eps, int(config.hc_mult)
        self.attn = CompressedAttention(config, layer, config.layer_types[layer])
        self.ffn = V4MoE(config, layer, config.mlp_layer_types[layer] == "hash_moe")
        self.attn_norm = Float32RMSNorm(d, eps)
        self.ffn_norm = Float32RMSNorm(d, eps)
        size = (2 + n) * n
        for block in ("attn", "ffn"):
            f32 = torch.float32
            self.register_buffer(f"hc_{block}_fn", torch.empty(size, n * d, dtype=f32))
            self.register_buffer(f"hc_{block}_base", torch.empty(size, dtype=f32))
            self.register_buffer(f"hc_{block}_scale", torch.empty(3, dtype=f32))
        self.hc = HyperConnection(n, int(config.hc_sinkhorn_iters), float(config.hc_eps), eps)

    def _collapse(self, h: torch.Tensor, block: str) -> tuple[torch.Tensor, ...]:
        return self.hc(h, *(getattr(self, f"hc_{block}_{p}") for p in ("fn", "base", "scale")))

    def forward(
        self, h: torch.Tensor, ctx: ForwardContext, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """h [T, N, D] -> [T, N, D]."""
        post, comb, x = self._collapse(h, "attn")
        h = expand(h, self.attn(self.attn_norm(x), ctx), post, comb)
        post, comb, x = self._collapse(h, "ffn")
        return expand(h, self.ffn(self.ffn_norm(x), input_ids), post, comb)


class V4CausalLM(CausalLM):
    """The embedding widened to N streams, the layers, then `hc_head`'s collapse and the norm."""

    def __init__(self, config: Any, layers: list[nn.Module]) -> None:
        super().__init__(config, layers)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.model.norm = Float32RMSNorm(d, eps)
        self.model.hc_head = HyperHead(int(config.hc_mult), d, float(config.hc_eps), eps)
        self.streams = int(config.hc_mult)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, D]."""
        x = self.model.embed_tokens(input_ids)  # [T, D]
        h = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()  # [T, N, D]
        for layer in self.model.layers:
            h = layer(h, ctx, input_ids)
        hc_head = cast(HyperHead, self.model.hc_head)
        return self.model.norm(hc_head(h))


def check_config(config: Any) -> None:
    """The layer schedules name kinds this module builds, one per layer."""
    n = config.num_hidden_layers
    for name, kinds in (("layer_types", LAYER_KINDS), ("mlp_layer_types", MLP_KINDS)):
        types = list(getattr(config, name, None) or [])
        if len(types) != n or any(t not in kinds for t in types):
            raise UnsupportedModelError(
                f"DeepSeek-V4: config.json {name} must name one of {kinds} per layer ({n} "
                f"layers), got {types}"
            )
    if getattr(config, "quantization_config", None) is not None:
        raise UnsupportedModelError(
            "DeepSeek-V4 checkpoints with a quantization_config (the released FP8/FP4 ones) are "
            "not supported: moetier reads V4 in float32/bfloat16/float16 as transformers saves it"
        )
    if getattr(config, "mlp_bias", False) or getattr(config, "attention_bias", False):
        raise UnsupportedModelError(
            "DeepSeek-V4 checkpoints with mlp_bias/attention_bias are "
            "not supported (transformers' V4 has no biases either)"
        )


def build(config: Any) -> CausalLM:
    check_config(config)
    layers: list[nn.Module] = [V4DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
    return V4CausalLM(config, layers)


def expert_prefixes(config: Any) -> dict[int, list[str]]:
    return {i: [f"model.layers.{i}.ffn"] for i in range(config.num_hidden_layers)}


FAMILY = register("DeepseekV4ForCausalLM")(
    Family(
        "deepseek_v4",
        build,
        expert_prefixes,
        (("lm_head.", "head."),),
        adapt_config=check_config,
        no_graphs="its attention sizes each sequence's history from host lengths",
    )
)
